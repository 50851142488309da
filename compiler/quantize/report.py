"""What quantization did to a model: layers quantized and kept (by reason), bytes, measured error."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .scheme import SCHEMES


@dataclass
class QuantReport:
    """scheme / family / policy: what was asked; quantized: layer names; kept: reason -> layer names;
    bytes_before / bytes_after: every parameter and buffer of the model, before and after;
    layer_error: layer -> relative L2 error of its output when quantized (calibrated), or of its
    weight (not calibrated), see error_kind; model_error: the whole model's relative L2 output
    error on the calibration calls (None without calibration)."""

    scheme: str
    family: str
    policy: dict
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    layer_error: dict[str, float] = field(default_factory=dict)
    error_kind: str = "weight"
    model_error: Optional[float] = None
    calibration_calls: int = 0
    notes: list[str] = field(default_factory=list)

    def keep(self, name: str, reason: str) -> None:
        self.kept.setdefault(reason, []).append(name)

    @property
    def kept_count(self) -> int:
        return sum(len(v) for v in self.kept.values())

    def summary(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        lines = [f"Kiln quantize {self.scheme} ({self.family}): {len(self.quantized)} layers quantized, "
                 f"{self.kept_count} kept in high precision; weights {_mib(self.bytes_before)} -> "
                 f"{_mib(self.bytes_after)} ({ratio:.0%})."]
        for reason, names in sorted(self.kept.items(), key=lambda item: -len(item[1])):
            shown = ", ".join(names[:4]) + (f", ... (+{len(names) - 4})" if len(names) > 4 else "")
            lines.append(f"  kept, {reason}: {len(names)} ({shown})")
        if self.layer_error:
            worst = sorted(self.layer_error.items(), key=lambda item: -item[1])[:3]
            quantized = set(self.quantized)
            errors = [e for name, e in self.layer_error.items() if name in quantized]
            mean = sum(errors) / len(errors) if errors else 0.0
            lines.append(f"  {self.error_kind} error of quantized layers (relative L2): mean {mean:.4f}; worst "
                         + ", ".join(f"{n} {e:.4f}" for n, e in worst))
        if self.model_error is not None:
            lines.append(f"  model output error on {self.calibration_calls} calibration calls (relative L2): "
                         f"{self.model_error:.4f}")
        if self.scheme in SCHEMES:  # a report read from a file may name a scheme this Kiln lacks
            lines.append(f"  saved, the file loads in: {SCHEMES[self.scheme].readers}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"scheme": self.scheme, "family": self.family, "policy": self.policy, "quantized": self.quantized,
                "kept": self.kept, "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "layer_error": self.layer_error, "error_kind": self.error_kind, "model_error": self.model_error,
                "calibration_calls": self.calibration_calls, "notes": self.notes}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
