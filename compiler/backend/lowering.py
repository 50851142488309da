"""How a rewritten FX graph becomes callable: one `Lowering` per mode, described once.

Everything that depends on the mode asks its Lowering (does it use Inductor? can it lower a
graph again with static sizes?) instead of comparing mode strings.
"""
from __future__ import annotations

import atexit
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from ...choices import COMPILE_MODES
from .. import compat
from ..shapes.inputs import activation_indices, shapes_key

log = logging.getLogger("kiln")


@dataclass(frozen=True)
class Lowering:
    mode: str               # a name of choices.COMPILE_MODES, which says what it means
    uses_inductor: bool     # Inductor generates the code (so `inductor` options apply, and it fuses neighbours itself)
    can_specialise: bool    # the shape manager may lower the captured graph again with static sizes
    inductor_preset: Optional[str] = None  # torch.compile(mode=...) settings applied on top, e.g. max-autotune

    @property
    def description(self) -> str:
        return COMPILE_MODES[self.mode]

    def lower(self, gm, example_inputs, options, device: str, cache_tag: str = ""):
        """(callable, name): the graph lowered for `device` with `options` (a CompileOptions).
        `cache_tag` goes into Inductor's FX graph cache key (Kiln's pass and kernel sources)."""
        cuda_graphs = bool(options.cuda_graphs and device == "cuda")
        if not self.uses_inductor:
            if cuda_graphs:
                return CudaGraphsPerShape(gm), "fx + cudagraphs"
            return gm.forward, "fx"
        if device == "cpu":
            probe_cpu_once()
            build_cpu_header_ahead()
        config = compat.inductor_mode_options(self.inductor_preset) if self.inductor_preset else {}
        config["triton.cudagraphs"] = cuda_graphs
        config.update(options.inductor)
        with compat.inductor_config_patch(config), compat.cache_key_tag(cache_tag):
            compiled = compat.inductor_backend(device)(gm, example_inputs)
        name = "inductor" + (f" {self.inductor_preset}" if self.inductor_preset else "") + (" + cudagraphs" if cuda_graphs else "")
        return compiled, name


def probe_cpu_once() -> None:
    """Before a process's first CPU lowering, let Inductor probe the CPU's vector instruction sets
    the faster way (compat.detect_cpu_vector_isa: the sets in parallel), saying how long it took."""
    if compat.cpu_vector_isa_detected():
        return
    start = time.perf_counter()
    compat.detect_cpu_vector_isa()
    log.info("Kiln: Inductor probed the CPU's vector instruction sets in %.1fs (once a process; "
             "the sets checked in parallel)", time.perf_counter() - start)


_header_asked = False  # Inductor's CPU kernel header asked for ahead in this process (once), or that turned off
_header_thread: Optional[threading.Thread] = None
_exiting = False  # the process waits for the build at exit: a build stopped then is not a failure to report
_COUNT_OF_ERRORS = re.compile(r"\d+ errors? generated\.", re.IGNORECASE)  # clang's last line


def build_cpu_header_ahead() -> None:
    """Once a process, after the CPU probe: have Inductor's precompiled header for CPU kernels built in
    a thread (compat.cpu_kernel_header_build) while this lowering traces and generates code on the main
    thread, instead of at its first kernel build. On a machine's first compile (and after the system's
    temporary folder was cleared, where Kiln's cache does not hold the header) that is 5-7 s of one gcc
    on a 2-core CPU, most of it now beside the first graph's trace; where the header exists the thread
    only checks it (about 0.2 s). Inductor asking for the header meanwhile waits on the same gcc (its
    file lock) rather than starting another. Nothing here stops a lowering: a failure costs only the
    overlap (Inductor builds the header itself), said in the log. At exit the process waits up to 60 s
    for a build still running, so the header's file lock is held until gcc has written it."""
    global _header_asked, _header_thread
    if _header_asked:
        return
    _header_asked = True
    try:
        build, why_not = compat.cpu_kernel_header_build()
        if build is None:
            log.info("Kiln: Inductor's C++ header for CPU kernels is not built ahead: %s", why_not)
            return
        thread = threading.Thread(target=_build_cpu_header, args=(build,), name="kiln-cpu-header", daemon=True)
        thread.start()
    except Exception as exc:  # noqa: BLE001  ahead of time only: it never stops a lowering
        _say_not_built_ahead(exc)
        return
    _header_thread = thread
    atexit.register(_wait_for_header_build)


def _build_cpu_header(build: Callable[[], str]) -> None:
    start = time.perf_counter()
    try:
        build()
    except Exception as exc:  # noqa: BLE001  ahead of time only: Inductor builds it when it needs it
        if not _exiting:
            _say_not_built_ahead(exc)
        return
    log.info("Kiln: Inductor's C++ header for CPU kernels ready in %.1fs (checked, or built beside the first "
             "lowering; once a process)", time.perf_counter() - start)


def _say_not_built_ahead(exc: Exception) -> None:
    log.warning("Kiln: Inductor's C++ header for CPU kernels could not be built ahead (%s); Inductor builds it "
                "at its first kernel", _failure_text(exc))


def _failure_text(exc: Exception) -> str:
    """The exception's type and the line that says what failed: the last line naming an error in the
    compiler's output (gcc ends its own with "compilation terminated.", clang with "1 error generated."),
    looked for in the exception's `output` (Inductor's CppCompileError, CalledProcessError), its
    `stderr`, then its message; else that text's last line."""
    for text in (getattr(exc, "output", None), getattr(exc, "stderr", None), str(exc)):
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()] if isinstance(text, str) else []
        if lines:
            errors = [line for line in lines if "error" in line.lower() and not _COUNT_OF_ERRORS.fullmatch(line)]
            return f"{type(exc).__name__}: {(errors or lines)[-1][:300]}"
    return type(exc).__name__


def _wait_for_header_build(seconds: float = 60.0) -> None:
    global _exiting
    _exiting = True
    if _header_thread is not None and _header_thread.is_alive():
        _header_thread.join(seconds)


class LoweringFailed(RuntimeError):
    """A lowering made on a graph's first call at a new signature failed (its cause is chained): it
    counts as a failed compile, so the graph's model or region runs eagerly, said with the reason."""


class CudaGraphsPerShape:
    """Mode fast's CUDA graphs, one recording per shape signature. torch's `cudagraphs` backend keys
    its recordings by the graph's integer inputs, and a size that reaches the graph only through a
    tensor (often the batch) is not one: a new batch was copied into the first batch's buffers and
    failed ("The size of tensor a (2) must match the size of tensor b (4)", seen on an H200). Here a
    `cudagraphs` callable is made per signature of the activations (shapes_key: the non-weight
    inputs' shapes and strides, as the shape manager keys them), on that signature's first call, and
    only where Kiln's bound on recordings admits it (compat.cuda_graph_capture_allowed, the question
    Inductor asks before recording); a signature refused runs the graph as captured, without CUDA
    graphs. The callable is made from the graph with the signature's sizes written in
    (graph_for_signature). A failure to make one raises LoweringFailed."""

    def __init__(self, gm):
        self.gm = gm
        self.activations = activation_indices(gm)
        self.by_signature: dict[tuple, Recording] = {}

    def __call__(self, *args):
        signature = shapes_key(args, self.activations)
        if not compat.cuda_graph_capture_allowed(signature):
            return self.gm(*args)
        recording = self.by_signature.get(signature)
        if recording is None:
            start = time.perf_counter()
            try:
                sized, takes = graph_for_signature(self.gm, args, self.activations)
                recording = Recording(compat.lookup_backend("cudagraphs")(sized, [args[i] for i in takes]), takes)
            except Exception as exc:
                raise LoweringFailed(f"CUDA graphs for a new shape could not be made: {type(exc).__name__}: {exc}") from exc
            self.by_signature[signature] = recording
            log.info("Kiln: CUDA graphs prepared for shape signature %d of this graph in %.1fs",
                     len(self.by_signature), time.perf_counter() - start)
        return recording.run(*[args[i] for i in recording.takes])


class Recording(NamedTuple):
    """One shape signature's CUDA-graphed callable and the positions of the graph's inputs it takes."""
    run: Callable
    takes: list[int]


def _value(value):
    """A size written into a graph: the value itself (a node, so that a method called on the size
    stays valid code)."""
    return value


def graph_for_signature(gm: torch.fx.GraphModule, args, keyed: list[int]) -> tuple[torch.fx.GraphModule, list[int]]:
    """A copy of `gm` in which each input that is not a tensor (a size TorchDynamo passes as a symbolic
    integer) is replaced by its value in `args`, and the positions of the inputs the copy still takes.
    Only inputs at `keyed` (the positions the signature is keyed by) may be written in, so that a
    recording made from the copy serves exactly its signature. torch's `cudagraphs` backend needs
    this: it traces the graph it is given with the call's values and then reads a tensor or symbol
    from every input of the traced graph, which a plain integer input does not give it
    ("KeyError: 'fake_result'" for every region of a dynamic graph, seen on an H100)."""
    sized = compat.copy_graph_module(gm)
    placeholders = sized.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(args):
        raise ValueError(f"the graph takes {len(placeholders)} inputs, the call gave {len(args)}")
    takes = []
    for position, (node, value) in enumerate(zip(placeholders, args)):
        if isinstance(value, torch.Tensor):
            takes.append(position)
            continue
        if position not in keyed:
            raise ValueError(f"input {position} ({node.name}) is not a tensor and not part of the shape signature")
        with sized.graph.inserting_after(placeholders[-1]):
            written = sized.graph.call_function(_value, (value,))
        node.replace_all_uses_with(written)
        sized.graph.erase_node(node)
    sized.recompile()
    return sized, takes


LOWERINGS: dict[str, Lowering] = {lowering.mode: lowering for lowering in (
    Lowering("fast", uses_inductor=False, can_specialise=False),
    Lowering("balanced", uses_inductor=True, can_specialise=True),
    Lowering("max", uses_inductor=True, can_specialise=True, inductor_preset="max-autotune-no-cudagraphs"),
)}
assert tuple(LOWERINGS) == tuple(COMPILE_MODES), "one Lowering per compile mode of choices.py, in its order"
MODES = tuple(LOWERINGS)
