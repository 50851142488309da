"""Keep a block region compiled only where its compiled call measures faster than its blocks run eagerly.

Compiling a block pays when Inductor's code beats the block's library calls and Python by more than
what every compiled call adds (TorchDynamo's entry and guards, the wrappers of a dynamic graph).
Whether it does depends on the block, its size and the device, so it is measured, not assumed.

- **Measured.** By blocks, on a region's first call, right after it compiled, the call is timed both
  ways on copies of the same inputs (`time_both`: ROUNDS interleaved rounds, the median of each; on a
  GPU a sample is PIPELINED_CALLS calls issued back to back, as a step issues them; on a CPU the seam
  compiler/cpu sizes it). The region stays compiled only when it is at least MIN_GAIN faster;
  otherwise its blocks run eagerly from then on, said with both times (log,
  `kiln.stats(m).regions_eager`, the node's line), and the choice is kept in Kiln's cache under the
  region's signature, the inputs' shapes and the environment (CHOICE_FILE), so a later start finds
  it before capturing.
- **Judged by class** (`ClassVerdicts`; not on CUDA, where every region is measured:
  compiler/regional/gpu_choice.py). Once the first region of a block class measured slower
  compiled, or its first PREDICT_AFTER regions together gained less than CLASS_MIN_GAIN, or one of
  them measured under MIN_GAIN, the class's other regions on that model are not compiled. A class
  let through goes on only while its regions pay: once a later region measures slower, its regions
  not yet compiled are not compiled. A marginal gain is not worth more seconds of compiling, and one
  timing far off must not carry a class.
- **Not measured** (the region stays compiled; glue compiled by `glue_regions: auto` runs eagerly instead,
  compiler/regional/glue.py): a block with hooks, or with ComfyUI patches the block
  calls (a patch may keep state, and measuring runs the block 2 x ROUNDS more times), a region whose
  first call broke into several graphs or compiled again, where keeping a region eager is never
  chosen (autotuning, CUDA graphs), or with `measure_regions: false`.

The CPU's own rules (a convolution block is not compiled there; how many calls a sample takes) sit
behind the seam in compiler/cpu/region_rules.py. The measurements behind these constants are in
docs/measurements/ (2026-11-26-cpu-region-choice.md and the GPU runs of 2026-11-27).
"""
from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import cpu
from ..torch_compat import module_calls
from .gpu_time import WALL_CLOCK, RegionClock, clock_for

log = logging.getLogger("kiln")

ROUNDS = 5          # interleaved rounds; the median of each side
PIPELINED_CALLS = 8  # on a GPU, calls issued back to back for one sample (time_both) ...
COPIES_MEMORY_SHARE = 0.25  # ... fewer where their inputs' copies would take more of the GPU's free memory
MIN_GAIN = 0.03     # compiled must be at least 3% faster than eager to stay compiled
PREDICT_AFTER = 2   # regions of one block class measured before its other regions follow them
CLASS_MIN_GAIN = 0.10  # ... and what those regions must gain together for the class's others to be compiled
CHOICE_FILE = "region-choice.json"
MAX_CHOICE_BYTES = 1024


def stored_record(data: bytes, where: str, fields: tuple[str, ...], max_bytes: int, what: str) -> dict:
    """A region's record read back from Kiln's cache (a timing here, a verdict of nothing to fuse in
    compiler/regional/fusible.py): a JSON object of exactly `fields`, read as untrusted data. ValueError, naming
    `where` and what is wrong, when it is not; the values are the caller's to check."""
    if len(data) > max_bytes:
        raise ValueError(f"{where}: {len(data)} bytes, more than {what}'s {max_bytes}")
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # nested too deep: RecursionError
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(raw, dict) or set(raw) != set(fields):
        raise ValueError(f"{where}: expected exactly the field{'s' if len(fields) > 1 else ''} {' and '.join(fields)}")
    return raw


@dataclass(frozen=True)
class RegionTiming:
    """One region's call, timed compiled and eagerly on the same inputs (milliseconds, medians), by the
    clock named in `basis` (compiler/regional/gpu_time.py; '' for a timing read back from the cache);
    on CUDA the host's wall clock over the same calls beside it (`*_host_ms`), for the log."""

    compiled_ms: float
    eager_ms: float
    basis: str = ""
    compiled_host_ms: Optional[float] = None
    eager_host_ms: Optional[float] = None

    def gains(self, fraction: float) -> bool:
        """Compiled is at least `fraction` faster than eager."""
        return self.compiled_ms <= self.eager_ms * (1 - fraction)

    @property
    def compiled_pays(self) -> bool:
        return self.gains(MIN_GAIN)

    def line(self) -> str:
        by = f" by {self.basis}" if self.basis else ""
        line = (f"compiled {self.compiled_ms:.3f} ms, eager {self.eager_ms:.3f} ms a call{by} "
                f"({self.eager_ms / self.compiled_ms:.2f}x)")
        if self.compiled_host_ms is not None and self.eager_host_ms is not None and self.basis != WALL_CLOCK:
            line += (f"; host wall clock compiled {self.compiled_host_ms:.3f} ms, eager {self.eager_host_ms:.3f} ms "
                     f"({self.eager_host_ms / self.compiled_host_ms:.2f}x)")
        return line

    def reason(self) -> str:
        """Why the region runs eagerly: '' when compiled pays."""
        if self.compiled_pays:
            return ""
        return f"measured no faster compiled ({self.line()}; compiled must be {MIN_GAIN:.0%} faster)"

    def to_bytes(self) -> bytes:
        return json.dumps({"compiled_ms": self.compiled_ms, "eager_ms": self.eager_ms}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "RegionTiming":
        """A stored timing, read as untrusted data: ValueError naming the field when it is not one."""
        raw = stored_record(data, where, ("compiled_ms", "eager_ms"), MAX_CHOICE_BYTES, "a region timing")
        for name, value in raw.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{where}: {name}={str(value)[:40]} is not a positive time in milliseconds")
        return cls(float(raw["compiled_ms"]), float(raw["eager_ms"]))


class ClassVerdicts:
    """What the regions of each block class measured so far, on one model: when the first region of a
    class measured slower compiled than eager, once its first PREDICT_AFTER regions, together,
    gained less than CLASS_MIN_GAIN compiled or one of them measured no faster, or once a region
    compiled after those measured slower, the class's regions not yet compiled are not compiled
    either (each would cost a lowering to gain as little)."""

    def __init__(self):
        self.measured: dict[str, list[tuple[str, RegionTiming]]] = {}

    def record(self, block_class: str, region: str, timing: RegionTiming) -> None:
        self.measured.setdefault(block_class, []).append((region, timing))

    def predicted_eager(self, block_class: str) -> str:
        """Why the class's next region is not compiled ('' when it is)."""
        measured = self.measured.get(block_class, [])
        if measured and not measured[0][1].gains(0.0):
            region, timing = measured[0]
            return f"not compiled: the first region of its class ({region}) measured slower compiled ({timing.line()})"
        first = measured[:PREDICT_AFTER]
        if len(first) < PREDICT_AFTER:
            return ""
        together = RegionTiming(sum(t.compiled_ms for _, t in first), sum(t.eager_ms for _, t in first))
        names = ", ".join(name for name, _ in first)
        if not together.gains(CLASS_MIN_GAIN):
            return (f"not compiled: the first {PREDICT_AFTER} regions of its class ({names}) gained less than "
                    f"{CLASS_MIN_GAIN:.0%} compiled together ({together.line()})")
        for region, timing in first:  # one timing far off must not carry a class
            if not timing.compiled_pays:
                return (f"not compiled: {region}, of the first {PREDICT_AFTER} regions of its class ({names}), "
                        f"measured no faster compiled ({timing.line()})")
        for region, timing in measured[PREDICT_AFTER:]:  # the class's regions differ in size, and so does the gain
            if not timing.gains(0.0):
                return (f"not compiled: {region}, compiled after the first {PREDICT_AFTER} regions of its class "
                        f"({names}), measured slower compiled ({timing.line()})")
        return ""


def why_not_measured(block: torch.nn.Module, patched: bool) -> str:
    """Why timing this block's calls again could change what the model does ('' when it cannot):
    hooks on the block or its layers, or patches (`patched`) the block calls, may keep state."""
    if patched:
        return "ComfyUI patches that the block calls are installed"
    for name, module in block.named_modules():
        if module_calls.has_forward_hooks(module):
            return f"{name or 'the block'} has forward hooks"
    return ""


def fresh_copies(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's inputs again, for one more call: tensors cloned with their strides and their kind
    (inference tensor or not), since a block may update its input in place (ComfyUI's Flux blocks
    do); dicts copied one level (what a block writes into transformer_options lands in the copy)."""
    def copy(value):
        if isinstance(value, torch.Tensor):  # an inference tensor, or not, as the original (TorchDynamo guards on it)
            with torch.inference_mode(value.is_inference()):
                return value.clone(memory_format=torch.preserve_format)
        if isinstance(value, dict):
            return {key: copy(item) if isinstance(item, torch.Tensor) else item for key, item in value.items()}
        return value
    return tuple(copy(a) for a in args), {key: copy(v) for key, v in kwargs.items()}


def calls_per_sample(device: str, input_bytes: int, call_ms: float) -> int:
    """Calls timed together for one sample. On a GPU PIPELINED_CALLS (see time_both), fewer (at least
    one) where that many copies of inputs of `input_bytes` would take more than COPIES_MEMORY_SHARE of
    its free memory; on a CPU as the seam says (compiler/cpu: sized by `call_ms`, one eager call's
    time); elsewhere one."""
    if device == "cpu":
        return cpu.calls_per_sample(input_bytes, call_ms)
    if device != "cuda":
        return 1
    if input_bytes == 0:
        return PIPELINED_CALLS
    return max(1, min(PIPELINED_CALLS, int(_free_gpu_bytes() * COPIES_MEMORY_SHARE) // input_bytes))


def input_bytes(args: tuple, kwargs: dict) -> int:
    """The bytes fresh_copies copies for one call: the tensors given, and those in dicts given."""
    def size(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(size(item) for item in value.values() if isinstance(item, torch.Tensor))
        return 0
    return sum(size(v) for v in (*args, *kwargs.values()))


def _free_gpu_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


def time_both(compiled: Callable[[tuple, dict], Any], eager: Callable[[tuple, dict], Any], args: tuple,
              kwargs: dict, device: str, rounds: int = ROUNDS, clock: Optional[RegionClock] = None) -> RegionTiming:
    """Median milliseconds a call of `compiled(args, kwargs)` and `eager(args, kwargs)`, each call on
    fresh copies of the inputs (made outside the timing), in interleaved rounds whose order alternates,
    after one warm-up call of each. Each sample is read from `clock` (compiler/regional/gpu_time.py;
    by default `clock_for(device)`: the GPU's own time on CUDA, the host's wall clock elsewhere).

    On a CPU a sample is calls_per_sample calls, sized by an eager call of the warm-up. On a GPU a
    sample is PIPELINED_CALLS calls issued back to back, divided by their number, timed by the GPU's
    clock: the kernels' own time, which Inductor's fusion lowers and CUDA graphs cannot, with the host's
    wall clock over the same calls beside it for the log (on a host-bound machine the wall clock can call
    slower a block that does less GPU work: docs/measurements/2026-11-27-gpu-h200.md)."""
    clock = clock or clock_for(device)
    samples: dict[str, list[float]] = {"compiled": [], "eager": []}
    host: dict[str, list[float]] = {"compiled": [], "eager": []}
    calls = {"compiled": compiled, "eager": eager}
    size = input_bytes(args, kwargs)
    eager_call_ms = _warm_up(compiled, eager, args, kwargs)
    count = calls_per_sample(device, size, eager_call_ms if device == "cpu" else 0.0)
    if device == "cuda" and count < PIPELINED_CALLS:
        log.info("Kiln: a region timed with %d call(s) a sample instead of %d: more copies of its inputs "
                 "(%.0f MiB each) would take over %.0f%% of the GPU's free memory", count, PIPELINED_CALLS,
                 size / 2 ** 20, COPIES_MEMORY_SHARE * 100)
    for round_ in range(rounds):
        for name in ("compiled", "eager") if round_ % 2 == 0 else ("eager", "compiled"):
            inputs = [fresh_copies(args, kwargs) for _ in range(count)]

            def run(call=calls[name], inputs=inputs):
                for given_args, given_kwargs in inputs:
                    call(given_args, given_kwargs)

            sample = clock.sample(run)
            samples[name].append(sample.ms / count)
            host[name].append(sample.host_ms / count)
            del inputs
    return RegionTiming(statistics.median(samples["compiled"]), statistics.median(samples["eager"]), clock.basis,
                        statistics.median(host["compiled"]), statistics.median(host["eager"]))


def _warm_up(compiled: Callable[[tuple, dict], Any], eager: Callable[[tuple, dict], Any], args: tuple,
             kwargs: dict) -> float:
    """One call of each side, outside the samples (a first call right after a compile can time slower than
    later ones; on a GPU it may still load or tune kernels),
    the eager one timed to size the samples on a CPU."""
    compiled(*fresh_copies(args, kwargs))
    given_args, given_kwargs = fresh_copies(args, kwargs)
    start = time.perf_counter()
    eager(given_args, given_kwargs)
    return (time.perf_counter() - start) * 1e3
