"""torch's CUDA graph trees: which shapes may record, and one Kiln call as one step.

Private or version-dependent torch APIs Kiln touches live in this package only; each helper says
which torch versions it was checked against."""
from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Optional

import torch

from .dynamo import ConfigScope
from .inductor import is_inductor_option


def cuda_graph_capture_gate(gate) -> Optional[Callable]:
    """A zero-argument factory of a context in which torch's CUDA graph trees ask `int_key in gate`
    before recording or replaying a shape (`triton.cudagraph_capture_sizes`, read on every call;
    checked: torch 2.11 - 2.13). Set and restored around the call (a ConfigScope), never left set.
    None, with a warning, where torch lacks the setting."""
    import torch._inductor.config as inductor_config

    if not is_inductor_option("triton.cudagraph_capture_sizes"):
        import logging

        logging.getLogger("kiln").warning(
            "Kiln: torch %s cannot bound CUDA graph recordings (no triton.cudagraph_capture_sizes): "
            "shapes.max_cuda_graphs is not enforced; every shape records its own CUDA graph", torch.__version__)
        return None
    return lambda: ConfigScope(inductor_config.triton, {"cudagraph_capture_sizes": gate})


def cuda_graph_capture_allowed(signature) -> bool:
    """Whether torch's CUDA graphs may record or replay for `signature`: what Inductor asks before each
    call of a CUDA-graphed graph (`is_cudagraph_capture_sizes`, answered by Kiln's budget while a Kiln
    call runs: cuda_graph_capture_gate; checked: torch 2.11, 2.13)."""
    from torch._inductor.cudagraph_trees import is_cudagraph_capture_sizes

    return is_cudagraph_capture_sizes(signature)


# Kiln's step numbers: far below any that mark_step_begin() counts down to, and far apart, so that
# other code marking steps inside a Kiln call never lands on Kiln's next number
KILN_STEPS_FROM = -(1 << 50)


KILN_STEP_SPACING = 1 << 20


_steps = itertools.count(1)


@contextlib.contextmanager
def cuda_graph_step():
    """One call of a Kiln model as one step ("generation") of torch's CUDA graph trees, however many
    compiled graphs it runs. By default the trees start a new step at every entry into compiled code
    from eager code, and a new step may reuse the memory of every output of the last: by blocks, the
    output of one region (a UNet's skip connection) would be overwritten by the next region's replay.
    Inside this context the step is the model call: the regions' graphs are recorded as one path,
    each block at its place with its own weights, and their outputs stay valid through the call. It
    does what `torch.compiler.cudagraph_mark_step_begin()` does, with a step number of Kiln's own
    that no other caller uses, and puts the process-wide marker back after (`MarkStepBox`, read on
    every call of a CUDA-graphed function; checked: torch 2.11, 2.13), so CUDA-graphed code of
    others keeps torch's own step rule. The marker is the process's: CUDA-graphed Kiln models are
    called from one thread at a time (as a ComfyUI server runs its prompts)."""
    from torch._inductor.cudagraph_trees import MarkStepBox

    before = MarkStepBox.mark_step_counter
    if before <= KILN_STEPS_FROM:  # a Kiln model called inside another's call: the outer call is the step
        yield
        return
    MarkStepBox.mark_step_counter = KILN_STEPS_FROM - next(_steps) * KILN_STEP_SPACING
    try:
        yield
    finally:
        MarkStepBox.mark_step_counter = before
