"""Recording one whole model call and replaying it: the `Recorder` protocol and its CUDA implementation.

A `Recorder` makes a `Recording` of `run(args, kwargs)` (the model call without graphs). Every
recorder follows the same steps, which tests check with compiler/graphs/fake_recorder.py:

1. static buffers for the call's tensors (compiler/graphs/static_inputs.py), the call made on them;
2. warm-up: the call run on the buffers until a run compiles nothing (cuDNN's benchmark, Triton's
   autotuning and any last TorchDynamo guard settle there), at most MAX_WARMUP_CALLS runs; still
   compiling after that, or compiling during the capture itself, aborts the recording
   (`CaptureAborted`);
3. the capture (Python's garbage collector off meanwhile: `no_collection`); `replay(args, kwargs)` then copies the call's tensors into the buffers and replays.

A replay's outputs live in the recording's memory and are overwritten by its next replay: the caller
clones them (compiler/graphs/whole_call.py), so a call's output stays valid after the next call.

`CudaGraphRecorder` records with `torch.cuda.CUDAGraph` on a side stream, every recording of a model
in one private memory pool (shared where the allocator allows it: compiler/graphs/allocator.py), and
reports each recording's memory (`nbytes`: what the device's allocated memory grew by).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Optional, Protocol

import torch

from ..host_inputs import HostInputs
from .static_inputs import StaticInputs

MAX_WARMUP_CALLS = 3   # warm-up runs before a capture; one that still compiles after this many aborts it

Run = Callable[[tuple, dict], Any]


class CaptureAborted(RuntimeError):
    """The call kept compiling during warm-up or compiled during its capture; the message says which."""


class Recording(Protocol):
    inputs: StaticInputs
    nbytes: int          # device memory the recording holds (static buffers, outputs, its activations)

    def replay(self, args: tuple, kwargs: dict) -> Any:
        """Copy the call's tensors in and replay; the outputs are valid until the next replay."""


class Recorder(Protocol):
    def record(self, run: Run, args: tuple, kwargs: dict, host: HostInputs,
               compiles: Callable[[], int]) -> Recording:
        """A recording of `run` at this call's key. `compiles()` counts the model's compiles so far."""


def warm_up(run: Run, inputs: StaticInputs, compiles: Callable[[], int]) -> None:
    """Run the call on its static buffers until a run compiles nothing (MAX_WARMUP_CALLS at most)."""
    for _ in range(MAX_WARMUP_CALLS):
        before = compiles()
        run(inputs.args, inputs.kwargs)
        if compiles() == before:
            return
    raise CaptureAborted(f"it still compiled after {MAX_WARMUP_CALLS} warm-up calls (MAX_WARMUP_CALLS)")


@contextlib.contextmanager
def no_collection():
    """Python's garbage collector off while a graph is captured (as vLLM captures): a collection would
    free unrelated tensors in the middle of the capture and slow it down."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CudaGraphRecording:
    def __init__(self, graph: "torch.cuda.CUDAGraph", inputs: StaticInputs, outputs: Any, nbytes: int):
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.nbytes = nbytes

    def replay(self, args: tuple, kwargs: dict) -> Any:
        self.inputs.copy_in(args, kwargs)
        self.graph.replay()
        return self.outputs


class CudaGraphRecorder:
    """Records with torch.cuda.CUDAGraph, every recording of one model in one memory pool."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.pool: Optional[tuple] = None

    def record(self, run: Run, args: tuple, kwargs: dict, host: HostInputs,
               compiles: Callable[[], int]) -> CudaGraphRecording:
        before_bytes = torch.cuda.memory_allocated(self.device)
        inputs = StaticInputs(args, kwargs, host)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            warm_up(run, inputs, compiles)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        before = compiles()
        with no_collection(), torch.cuda.graph(graph, pool=self.pool):
            outputs = run(inputs.args, inputs.kwargs)
        if compiles() != before:
            raise CaptureAborted("it compiled while being recorded")
        nbytes = max(torch.cuda.memory_allocated(self.device) - before_bytes, inputs.nbytes)
        return CudaGraphRecording(graph, inputs, outputs, nbytes)


__all__ = ["Recorder", "Recording", "CudaGraphRecorder", "CudaGraphRecording", "CaptureAborted", "warm_up",
           "MAX_WARMUP_CALLS"]
