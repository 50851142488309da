"""Calibration: run a few denoising steps on the user's own float model and measure, for every
candidate layer, how far its output moves when that one layer is quantized.

Forward hooks on the float layers feed each layer's real input to its quantized twin and add up
the squared error; a hook on the whole model keeps a few of its calls (inputs and output) so the
quantized model's end-to-end error can be measured on the same inputs afterwards.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class _ErrorMeter:
    def __init__(self):
        self.err = 0.0
        self.ref = 0.0

    def add(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        out, ref = out.float(), ref.float()
        self.err += (out - ref).pow(2).sum().item()
        self.ref += ref.pow(2).sum().item()

    @property
    def value(self) -> float:
        return (self.err / self.ref) ** 0.5 if self.ref > 0 else 0.0


def layer_errors(module: torch.nn.Module, twins: dict[str, torch.nn.Module], run: Callable[[], Any],
                 keep_calls: int = 4) -> tuple[dict[str, float], list[tuple[tuple, dict, torch.Tensor]]]:
    """Run `run()` (which calls `module` a few times) with hooks: returns ({layer: relative L2 error
    of its quantized twin's output}, up to `keep_calls` of the model's calls as (args, kwargs, output))."""
    meters = {name: _ErrorMeter() for name in twins}
    calls: list[tuple[tuple, dict, torch.Tensor]] = []
    pending: list[tuple[tuple, dict]] = []
    handles = []

    def layer_hook(name):
        twin, meter = twins[name], meters[name]

        def hook(layer, inputs, output):
            meter.add(twin(inputs[0]), output)
        return hook

    def before_model(_, args, kwargs):
        if len(calls) + len(pending) < keep_calls:
            pending.append((_detached(args), _detached(kwargs)))

    def after_model(_, args, kwargs, output):
        if pending:
            call_args, call_kwargs = pending.pop()
            calls.append((call_args, call_kwargs, _first_tensor(output).detach().clone()))

    try:
        for name, layer in module.named_modules():
            if name in twins:
                handles.append(layer.register_forward_hook(layer_hook(name)))
        handles.append(module.register_forward_pre_hook(before_model, with_kwargs=True))
        handles.append(module.register_forward_hook(after_model, with_kwargs=True))
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        raise RuntimeError("calibration ran, but the model was never called: nothing was measured")
    return {name: meter.value for name, meter in meters.items()}, calls


def model_error(module: torch.nn.Module, calls: list[tuple[tuple, dict, torch.Tensor]]) -> float:
    """Relative L2 error of `module`'s outputs against the recorded float outputs."""
    meter = _ErrorMeter()
    with torch.no_grad():
        for args, kwargs, ref in calls:
            meter.add(_first_tensor(module(*args, **kwargs)), ref)
    return meter.value


def _first_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if hasattr(output, "sample"):  # diffusers' output dataclasses
        return output.sample
    raise TypeError(f"calibration cannot read a tensor from the model's output ({type(output).__name__})")


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value
