"""Everything Kiln does only where a model runs on a CPU, behind one seam.

Kiln's market is the GPU; a CPU is its test bed. So the rest of the compiler asks this room a
question where a CPU differs, and nothing else in it branches on "cpu":

- `before_lowering(device)` (lowering.py): Inductor's probe of the CPU's vector instruction sets
  runs once a process in Inductor's own cache folder, before Kiln's cache points Inductor at a
  lowering's private folder, so that its test programs are built once a machine, not once a process.
- `inductor_compile(device)` (lowering.py): Inductor's compile without the Triton worker processes
  its registered backend starts, which a CPU graph (C++ kernels) never uses.
- `eager_before_capture(block, device)` (region_rules.py): a block with most of its weights in
  convolutions is not compiled on a CPU (CPU_CONVOLUTION_SHARE).
- `calls_per_sample(input_bytes, call_ms)` (region_rules.py): how many calls one timing sample of a
  region takes on a CPU (MIN_SAMPLE_MS, MAX_CPU_CALLS, CPU_COPIES_BYTES).

The rule for what may live here: a CPU-only optimisation stays only while `kiln bench` shows that it
saves at least MIN_FIRST_CALL_SAVING of the CPU first call, measured side by side in one run, or
while removing it would add MIN_SUITE_SAVING or more to the test suite's time on 2 cores; the rest
is deleted with its tests. docs/measurements/2026-12-02-cpu-seam.md has the measurements behind
each one kept and each one removed.
"""
from .lowering import before_lowering, inductor_compile
from .region_rules import calls_per_sample, eager_before_capture

MIN_FIRST_CALL_SAVING = 0.10  # of `kiln bench`'s CPU first call, side by side in one run
MIN_SUITE_SAVING = 0.03       # of the whole test suite's time on 2 cores, two alternating runs

__all__ = ["before_lowering", "inductor_compile", "eager_before_capture", "calls_per_sample",
           "MIN_FIRST_CALL_SAVING", "MIN_SUITE_SAVING"]
