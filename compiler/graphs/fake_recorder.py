"""A recorder with a CUDA graph's semantics on any device, for tests on a CPU.

`FakeRecorder` follows every step of compiler/graphs/recorder.py except the capture: a replay
runs the call again, but only ever on what a CUDA graph would read, so the mistakes a real replay
would make show up on a CPU too:

- it reads its inputs from its static buffers only: a tensor the caller failed to copy in
  replays the values it was recorded with;
- it calls the model with the Python values of the recorded call (the static arguments): a number
  that changed without changing the key replays stale;
- it checks that the model's weights are still at the addresses it was recorded with, and raises
  `StaleWeights` if not: a CUDA graph would read memory no longer the weights';
- its outputs are buffers of its own, overwritten by the next replay, as a CUDA graph's are.

`skip_copy` (places, as the recording key names them) plants a missed input copy, for the guard's tests.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..host_inputs import HostInputs
from ..torch_compat import module_calls
from .recorder import CaptureAborted, Run, warm_up
from .recording_key import weight_addresses
from .static_inputs import StaticInputs


class StaleWeights(RuntimeError):
    """A replay found the model's weights moved since its recording."""


class FakeRecording:
    def __init__(self, run: Run, inputs: StaticInputs, outputs: Any, module: torch.nn.Module,
                 skip_copy: frozenset):
        self.run = run
        self.inputs = inputs
        self.outputs = outputs
        self.module = module
        self.weights = weight_addresses(module)
        self.skip_copy = skip_copy
        self.nbytes = inputs.nbytes + sum(t.untyped_storage().nbytes() for t in _tensors(outputs))
        self.replays = 0

    def replay(self, args: tuple, kwargs: dict) -> Any:
        if weight_addresses(self.module) != self.weights:
            raise StaleWeights("the model's weights moved since this recording: a CUDA graph would read freed memory")
        self.inputs.copy_in(args, kwargs, self.skip_copy)
        fresh = self.run(self.inputs.args, self.inputs.kwargs)
        for static, value in zip(_tensors(self.outputs), _tensors(fresh)):
            static.copy_(value)
        self.replays += 1
        return self.outputs


class FakeRecorder:
    """Records by running the call on static buffers; see the module docstring."""

    def __init__(self, module: torch.nn.Module, skip_copy: frozenset = frozenset()):
        self.module = module
        self.skip_copy = skip_copy
        self.recordings: list[FakeRecording] = []

    def record(self, run: Run, args: tuple, kwargs: dict, host: HostInputs,
               compiles: Callable[[], int]) -> FakeRecording:
        inputs = StaticInputs(args, kwargs, host)
        warm_up(run, inputs, compiles)
        before = compiles()
        outputs = module_calls.map_tensors(torch.clone, run(inputs.args, inputs.kwargs))
        if compiles() != before:
            raise CaptureAborted("it compiled while being recorded")
        recording = FakeRecording(run, inputs, outputs, self.module, self.skip_copy)
        self.recordings.append(recording)
        return recording


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    module_calls.map_tensors(found.append, value)
    return found


__all__ = ["FakeRecorder", "FakeRecording", "StaleWeights"]
