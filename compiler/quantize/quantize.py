"""`quantize(module, QuantizeOptions(...))`: a quantized copy of a diffusion model; the original is untouched."""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional, Union

import torch

from . import calibrate as calibration
from .layers import QuantConv2d, QuantLinear, quantized_layers
from .policy import LayerPolicy, detect_family, parse_policy
from .report import QuantReport
from .scheme import QuantizeError, Scheme, scheme_named
from .speed_rule import IMAGE_ROWS, rows_at_reference

log = logging.getLogger("kiln")

REPORT_ATTR = "kiln_quant_report"  # the quantized module's QuantReport
_KILN_STATE = ("_kiln_models", "_kiln_last_plan")  # KilnModel memos (compiler/model.py): never copied
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class QuantizeOptions:
    """The quantize part of a Kiln plan: scheme, layer policy, and calibration (denoising steps
    run to measure each layer's error, 0 for none; layers above error_threshold are kept)."""

    scheme: str = "int8_weight"
    policy: LayerPolicy = LayerPolicy()
    calibration_steps: int = 0
    error_threshold: float = 0.05

    def __post_init__(self):
        scheme_named(self.scheme)
        if self.calibration_steps < 0 or not 0 < self.error_threshold:
            raise QuantizeError("calibration_steps must be >= 0 and error_threshold > 0, got "
                                f"{self.calibration_steps} and {self.error_threshold}")

    def as_dict(self) -> dict:
        return {"scheme": self.scheme, "policy": self.policy.as_dict(), "calibration_steps": self.calibration_steps,
                "error_threshold": self.error_threshold}


def quantize(module: torch.nn.Module, options: Union[QuantizeOptions, str, Scheme] = "int8_weight",
             policy: Union[LayerPolicy, str, dict, None] = None, *, calibrate: Optional[Callable[[], Any]] = None,
             error_threshold: Optional[float] = None, device: Optional[Union[str, torch.device]] = None,
             share_kept: bool = False, copy_kept: Collection[str] = (), progress: Optional[Progress] = None
             ) -> torch.nn.Module:
    """A copy of `module` with its Linear (and Conv2d) layers quantized as `options` (a
    QuantizeOptions) says; `module` itself is never changed. The copy's `kiln_quant_report` (a
    QuantReport) says what was done.

    options: QuantizeOptions(scheme, policy, calibration_steps, error_threshold): the scheme,
        "int8_weight" | "int8_dynamic" | "fp8_e4m3" | "int8_tensorwise" (compiler/quantize/scheme.py);
        which layers stay in high precision (a LayerPolicy, compiler/quantize/policy.py; the default:
        the model family's defaults); and the error above which a calibrated layer stays in high precision. In short,
        the keyword forms: the scheme's name, with `policy` (a LayerPolicy, its YAML text or a dict)
        and `error_threshold` (default 0.05) beside it.
    calibrate: a function that runs `module` for a few denoising steps on real inputs; each
        candidate layer's output error when quantized is measured on them and layers above the
        error threshold (relative L2) stay in high precision. The report then has the measured
        per-layer and whole-model errors.
    device: where the quantized weights go (default: where each weight is).
    share_kept: the layers kept in high precision share their tensors' storage with `module`
        instead of being copied (no extra memory; new Parameter objects, so replacing a weight on
        one model does not change the other, but an in-place edit would show in both), except
        the parameters named in `copy_kept`, which are copied.

    Example:
        >>> unet8 = kiln.quantize(unet, kiln.QuantizeOptions("int8_dynamic", kiln.LayerPolicy(min_params=0)))
        >>> unet8 = kiln.quantize(unet, "int8_dynamic", policy="min_params: 0")  # the same, in short
        >>> print(unet8.kiln_quant_report.summary())
        >>> unet8 = kiln.compile(unet8)  # the compiler sees kiln:: ops; one graph for every shape
    """
    if isinstance(options, QuantizeOptions):
        if policy is not None or error_threshold is not None:
            raise QuantizeError("give the policy and error_threshold inside the QuantizeOptions, not beside it")
        scheme, policy, error_threshold = options.scheme, options.policy, options.error_threshold
    else:
        scheme, error_threshold = options, QuantizeOptions.error_threshold if error_threshold is None else error_threshold
    scheme = scheme_named(scheme) if isinstance(scheme, str) else scheme
    policy = _as_policy(policy)
    if quantized_layers(module):
        raise QuantizeError(f"{type(module).__name__} is already quantized by Kiln; quantize the original model")
    family = detect_family(module) if policy.family == "auto" else policy.family
    report = QuantReport(scheme=scheme.name, family=family, policy=policy.as_dict(), bytes_before=_bytes(module))

    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    rule = policy.speed_rule()
    rows = rows_at_reference(module, family) if rule is not None else {}
    if rule is not None:
        report.notes.append(f"GPU rule {rule.gpu_class} (min {rule.min_macs:.2g} MACs at the reference size, N and K "
                            f"multiples of {rule.align}; {rule.source}): layers whose quantized GEMM would not be "
                            f"faster there stay in high precision (layer policy gpu_rule: none quantizes them)")
    twins: dict[str, torch.nn.Module] = {}
    for done, (name, layer) in enumerate(layers, 1):
        speed = None if rule is None else (rule, *rows.get(name, (0, IMAGE_ROWS)))
        reason = policy.decide(name, layer, scheme, family, speed)
        if reason is None and isinstance(layer, torch.nn.Conv2d) and layer.padding_mode != "zeros":
            reason = f"convolution with padding_mode {layer.padding_mode!r}"
        if reason is None:
            twins[name] = _quantized_twin(layer, scheme)
        else:
            report.keep(name, reason)
        if progress is not None:
            progress(f"quantize {name}", done, len(layers))

    if calibrate is not None:
        errors, calls = calibration.layer_errors(module, twins, calibrate)
        report.layer_error, report.error_kind, report.calibration_calls = errors, "output (calibrated)", len(calls)
        for name, error in errors.items():
            if error > error_threshold:
                report.keep(name, f"calibration error > {error_threshold}")
                del twins[name]
    else:
        report.layer_error = {name: _weight_error(twins[name], dict(layers)[name]) for name in twins}

    quantized = _copy_with(module, twins, device, share_kept, set(copy_kept))
    report.quantized = list(twins)
    report.bytes_after = _bytes(quantized)
    if calibrate is not None:
        report.model_error = calibration.model_error(quantized, calls)
    if not twins:
        report.notes.append("no layer was quantized: the policy kept them all")
    setattr(quantized, REPORT_ATTR, report)
    log.info("%s", report.summary())
    return quantized


def quant_report(module: torch.nn.Module) -> QuantReport:
    """The QuantReport of a module returned by `quantize` (or loaded from a Kiln file)."""
    report = getattr(module, REPORT_ATTR, None)
    if report is None:
        raise ValueError(f"{type(module).__name__} was not quantized by kiln.quantize")
    return report


def _as_policy(policy) -> LayerPolicy:
    if policy is None:
        return LayerPolicy()
    if isinstance(policy, LayerPolicy):
        return policy
    if isinstance(policy, str):
        return parse_policy(policy)
    if isinstance(policy, dict):
        import yaml

        return parse_policy(yaml.safe_dump(policy))
    raise QuantizeError(f"policy must be a LayerPolicy, YAML text or a dict, not {type(policy).__name__}")


def _quantized_twin(layer: torch.nn.Module, scheme: Scheme) -> torch.nn.Module:
    if isinstance(layer, torch.nn.Conv2d):
        return QuantConv2d.from_float(layer, scheme, out_device=layer.weight.device)
    return QuantLinear.from_float(layer, scheme, out_device=layer.weight.device)


def _weight_error(twin, layer) -> float:
    ref = layer.weight.detach().float()
    return ((twin.dequantized_weight() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _copy_with(module: torch.nn.Module, twins: dict[str, torch.nn.Module], device, share: bool,
               copy_names: set[str]) -> torch.nn.Module:
    """A deep copy of `module` with the layers in `twins` replaced by their quantized twins. Weights
    of quantized layers are not copied; kept ones are shared or copied (see `quantize`)."""
    memo: dict[int, Any] = {}
    skipped = {name + "." for name in twins}
    for name, param in module.named_parameters(remove_duplicate=False):
        if any(name.startswith(prefix) for prefix in skipped):
            memo[id(param)] = None  # replaced below: never copied
            continue
        memo[id(param)] = torch.nn.Parameter(_moved(param.detach(), device, share and name not in copy_names),
                                             requires_grad=False)
    for name, buf in module.named_buffers(remove_duplicate=False):
        memo[id(buf)] = _moved(buf, device, share and name not in copy_names)
    for key in _KILN_STATE:
        if key in module.__dict__:
            memo[id(module.__dict__[key])] = {} if key == "_kiln_models" else None
    copied = copy.deepcopy(module, memo)
    for key in _KILN_STATE:
        copied.__dict__.pop(key, None)
    for name, twin in twins.items():
        parent_name, _, child = name.rpartition(".")
        parent = copied.get_submodule(parent_name) if parent_name else copied
        setattr(parent, child, twin.to(device) if device is not None else twin)
    return copied


def _moved(tensor: torch.Tensor, device, share: bool) -> torch.Tensor:
    """`tensor` on `device`; its storage shared only if `share` (a move to another device copies anyway)."""
    moved = tensor.to(device) if device is not None else tensor
    return moved.clone() if not share and moved.data_ptr() == tensor.data_ptr() else moved


def _bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
