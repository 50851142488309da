"""Whether a kernel pass fires by default on a GPU class: a decision record per (kernel pass, GPU), measured in place.

A Kiln Triton kernel earns its pass on a GPU only where it beats Inductor's own code for its pattern
in a real step, not alone: Inductor fuses the kernel's neighbours into its code (the residual add
before a norm, the bias of the projection before a GEGLU), which a custom op splits, so a kernel that
wins a microbenchmark can lose in the step. So each record holds one in-place measurement: the GPU's
busy time per step (the kernels' own times, torch.profiler) of one model case compiled whole by Kiln in
mode balanced, with the pass forced on and with it off, everything else the same
(`python -m kiln.benchmarks.kernel_pass_records` writes them, `bash benchmarks/gpu_session.sh
kernel-records` runs it on a CUDA machine).

**The rule** (`decide`), where Inductor lowers the graph (modes balanced and max) on CUDA with the
pass on "auto": the pass fires on a GPU only when records for that GPU exist (RECORDS_FILE, matched on
the device's name: an H100's records say nothing of an H200) and at every case recorded the step
with the kernel took at least KERNEL_MIN_GAIN less GPU time than without. A GPU with a record that
lost, or with no record at all, gets no kernel (DEFAULT_WITHOUT_RECORD): a kernel is not assumed to
win where nobody measured it (docs/gpu-choices.md names the runs where Kiln's kernels lost). `passes: {name: on}` still forces a pass,
and the CPU is unchanged (the kernel passes stand aside there before any record is asked). In mode
fast no Inductor runs: the kernel competes with eager's ops, not Inductor's, which these records do
not measure, so mode fast keeps its rule (compiler/passes/base.py `kernel_gate`).

The records ship with the package in RECORDS_FILE (one source; `load_records` reads it as untrusted
data: every field checked, the file bounded by MAX_RECORDS_BYTES). Only a measurement in place, the
step with and without the pass, makes a record; a kernel timed alone makes none.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

log = logging.getLogger("kiln")

RECORDS_FILE = Path(__file__).with_name("kernel_records.json")
RECORDS_FORMAT = 1
MAX_RECORDS_BYTES = 256 * 1024
KERNEL_MIN_GAIN = 0.005  # the step with the kernel must take at least 0.5% less GPU busy time than without
DEFAULT_WITHOUT_RECORD = False  # a kernel pass on a GPU with no record: off (Inductor's code runs)
_CAPABILITY = re.compile(r"sm_[0-9]{2,3}[a-z]?")
_TEXT = re.compile(r"[A-Za-z0-9 ._:/()+-]{1,120}")
_FIELDS = ("kernel_pass", "gpu", "capability", "case", "busy_with_ms", "busy_without_ms", "step_with_ms",
           "step_without_ms", "date", "torch", "source")
_TIMES = ("busy_with_ms", "busy_without_ms", "step_with_ms", "step_without_ms")


@dataclass(frozen=True)
class GpuClass:
    """A GPU as the records key it: its device name ("NVIDIA H200") and compute capability ("sm_90")."""

    name: str
    capability: str

    def line(self) -> str:
        return f"{self.name} ({self.capability})"


@dataclass(frozen=True)
class KernelRecord:
    """One in-place measurement of a kernel pass on one GPU at one model case (milliseconds per step)."""

    kernel_pass: str
    gpu: str                # the device's name, as torch.cuda.get_device_name says it
    capability: str         # "sm_90"
    case: str               # the GPU suite's case, e.g. "sdxl-1024-cfg"
    busy_with_ms: float     # GPU busy per step with the pass forced on
    busy_without_ms: float  # ... and with it off
    step_with_ms: float     # wall time per step, with and without (for the reader; the rule reads busy time)
    step_without_ms: float
    date: str
    torch: str
    source: str             # the results file it came from, under benchmarks/results/

    @property
    def wins(self) -> bool:
        return self.busy_with_ms <= self.busy_without_ms * (1 - KERNEL_MIN_GAIN)

    def line(self) -> str:
        return (f"{self.case} on {self.date}: GPU busy {self.busy_with_ms:.3f} ms a step with the kernel, "
                f"{self.busy_without_ms:.3f} ms without ({self.busy_without_ms / self.busy_with_ms:.3f}x; "
                f"{self.source})")

    @classmethod
    def from_dict(cls, raw, where: str) -> "KernelRecord":
        """A record read as untrusted data: ValueError naming the field when it is not one."""
        if not isinstance(raw, dict) or set(raw) != set(_FIELDS):
            raise ValueError(f"{where}: expected an object with exactly the fields {', '.join(_FIELDS)}")
        for name in _TIMES:
            value = raw[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{where}: {name}={str(value)[:40]} is not a positive time in milliseconds")
        for name in set(_FIELDS) - set(_TIMES):
            if not isinstance(raw[name], str) or not _TEXT.fullmatch(raw[name]):
                raise ValueError(f"{where}: {name}={str(raw[name])[:40]!r} is not a short plain text")
        if not _CAPABILITY.fullmatch(raw["capability"]):
            raise ValueError(f"{where}: capability={raw['capability'][:40]!r} is not of the form sm_90")
        return cls(**{name: float(raw[name]) if name in _TIMES else raw[name] for name in _FIELDS})


@dataclass(frozen=True)
class KernelDecision:
    """Whether a kernel pass fires by default on a GPU, and why (the records behind it)."""

    kernel_pass: str
    gpu: str
    on: bool
    why: str
    records: tuple[KernelRecord, ...] = ()


def decide(kernel_pass: str, gpu: GpuClass, records: Iterable[KernelRecord]) -> KernelDecision:
    """The rule of the module docstring: on only where every record of `kernel_pass` on `gpu` shows the
    kernel winning by KERNEL_MIN_GAIN; off where one lost, and DEFAULT_WITHOUT_RECORD where none exists."""
    mine = tuple(r for r in records if r.kernel_pass == kernel_pass and r.gpu == gpu.name)
    if not mine:
        return KernelDecision(kernel_pass, gpu.name, DEFAULT_WITHOUT_RECORD,
                              f"no in-place measurement of {kernel_pass} on {gpu.line()} shows its kernel beating "
                              f"Inductor's code, so it is {'on' if DEFAULT_WITHOUT_RECORD else 'off'} there by default")
    lost = [r for r in mine if not r.wins]
    if lost:
        return KernelDecision(kernel_pass, gpu.name, False,
                              f"its kernel lost to Inductor's code in place on {gpu.line()} "
                              f"({'; '.join(r.line() for r in lost)}; it must save {KERNEL_MIN_GAIN:.1%})", mine)
    return KernelDecision(kernel_pass, gpu.name, True,
                          f"its kernel beat Inductor's code in place on {gpu.line()} "
                          f"({'; '.join(r.line() for r in mine)})", mine)


def load_records(path: Path = RECORDS_FILE) -> tuple[KernelRecord, ...]:
    """The records a file holds ({"format": RECORDS_FORMAT, "records": [...]}), checked (ValueError naming
    the file and the field when one is not a record)."""
    data = path.read_bytes()
    if len(data) > MAX_RECORDS_BYTES:
        raise ValueError(f"{path.name}: {len(data)} bytes, more than {MAX_RECORDS_BYTES}")
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path.name}: not JSON ({exc})") from None
    if not isinstance(raw, dict) or set(raw) != {"format", "records"} or raw["format"] != RECORDS_FORMAT \
            or not isinstance(raw["records"], list):
        raise ValueError(f'{path.name}: expected {{"format": {RECORDS_FORMAT}, "records": [...]}}')
    records = tuple(KernelRecord.from_dict(r, f"{path.name} record {i}") for i, r in enumerate(raw["records"]))
    keys = [(r.kernel_pass, r.gpu, r.case) for r in records]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path.name}: a (kernel pass, GPU, case) is recorded twice")
    return records


def records_text(records: Iterable[KernelRecord]) -> str:
    """The file's text for `records`, sorted by pass, GPU and case (what `load_records` reads)."""
    ordered = sorted(records, key=lambda r: (r.kernel_pass, r.gpu, r.case))
    return json.dumps({"format": RECORDS_FORMAT, "records": [asdict(r) for r in ordered]}, indent=2) + "\n"


def merged(old: Iterable[KernelRecord], new: Iterable[KernelRecord]) -> tuple[KernelRecord, ...]:
    """`old` with each (kernel pass, GPU, case) measured in `new` replaced by its new record."""
    fresh = {(r.kernel_pass, r.gpu, r.case): r for r in new}
    kept = [r for r in old if (r.kernel_pass, r.gpu, r.case) not in fresh]
    return tuple(kept) + tuple(fresh.values())


@functools.lru_cache(maxsize=None)
def shipped_records() -> tuple[KernelRecord, ...]:
    """The records shipped in RECORDS_FILE, read once a process."""
    return load_records(RECORDS_FILE)


def gpu_class_of(device: torch.device | str) -> Optional[GpuClass]:
    """The GPU class of a CUDA `device`; None for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return GpuClass(torch.cuda.get_device_name(device), f"sm_{major}{minor}")


def gpu_class_among(values) -> Optional[GpuClass]:
    """The GPU class of the first floating-point tensor among `values` when it lies on a CUDA device
    (the device a graph's kernels run on); None otherwise."""
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return gpu_class_of(value.device)
    return None


_said: set[tuple[str, str]] = set()


def shipped_decision(kernel_pass: str, gpu: GpuClass) -> KernelDecision:
    """`decide` over the shipped records, said in the log once a process per (pass, GPU)."""
    decision = decide(kernel_pass, gpu, shipped_records())
    if (kernel_pass, gpu.name) not in _said:
        _said.add((kernel_pass, gpu.name))
        log.info("Kiln: kernel pass %s is %s on %s by default: %s", kernel_pass, "on" if decision.on else "off",
                 gpu.line(), decision.why)
    return decision
