"""What a model may compile when its host loads it only partly onto the device: the memory verdict.

A host that cannot fit a model on its device keeps some layers' weights off it and brings them in
during each call (ComfyUI's partial load, "lowvram"). Compiling a block whose weights are brought in
so would trace the host's copies into the graph (without the host's own overlap of copy and compute)
and hold them as graph inputs; a whole-call CUDA graph would keep every weight it copied, at a fixed
address, in its pool. So, from the bytes the host reports (the compiler knows no host: nodes/ measures
them), `memory_verdict` decides:

- **fits**: every weight is resident. Whole-call CUDA graphs are allowed where the device has
  `inference_bytes` free beyond the load (RECORDING_ROOM_RULE: the recording's pool holds the call's
  activations a second time, beside what the host keeps free for the eager call).
- **partly resident**: the blocks with streamed weights (`BlockWeights.streamed_bytes > 0`) run
  eagerly, through the host's own offload path (its copies overlap the compute there; traced, they would
  not); the resident blocks compile as usual; no whole-call CUDA graph. The verdict's `why` says so with
  the numbers (model, resident, streamed, free, cap). A model compiled whole cannot leave a block out: it
  keeps its graph, with the host's casts in it (compiled code frees each copy after its last use, as the
  host's eager code does), and says so (KilnModel.use_memory).

A pure function of typed bytes: tested on a CPU with any sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

GIB = 2**30
# RECORDING_ROOM_RULE: a whole-call CUDA graph may record where the device has, free beyond the loaded
# weights, at least the memory the host keeps for one eager call (`inference_bytes`): the recording's
# private pool holds that call's activations once more, for as long as the recording lives.


@dataclass(frozen=True)
class BlockWeights:
    """One block of the model (its path, as the compiler's block finder names it) and its weights."""

    path: str
    nbytes: int           # every weight of the block
    streamed_bytes: int   # of those, what the host keeps off the device and copies in during each call

    def __post_init__(self):
        if not 0 <= self.streamed_bytes <= self.nbytes:
            raise ValueError(f"block {self.path}: streamed_bytes {self.streamed_bytes} must lie in 0..nbytes "
                             f"({self.nbytes})")


@dataclass(frozen=True)
class DeviceMemory:
    """The device's memory around one model call, in bytes, as the host reports it."""

    model_bytes: int       # every weight of the model
    resident_bytes: int    # of those, loaded on the device
    free_bytes: int        # free on the device after the load (the host's own count, within any cap)
    cap_bytes: int         # what this process may use on the device (the card, or a cap below it)
    inference_bytes: int   # what the host keeps free for one eager call's activations

    def __post_init__(self):
        for name in ("model_bytes", "resident_bytes", "free_bytes", "cap_bytes", "inference_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeviceMemory.{name} must not be negative, got {getattr(self, name)}")


@dataclass(frozen=True)
class MemoryVerdict:
    """What compiles under a partial load: `eager_blocks` run through the host's own path."""

    fits: bool                         # every weight is resident
    eager_blocks: tuple[str, ...] = ()  # blocks whose weights are streamed: kept eager
    cuda_graphs: bool = True           # whether a whole-call CUDA graph may record
    why: str = ""                      # "" when nothing is held back; else the reason with the numbers

    @property
    def holds_back(self) -> bool:
        return bool(self.eager_blocks) or not self.cuda_graphs or not self.fits


def memory_verdict(memory: DeviceMemory, blocks: Sequence[BlockWeights] = ()) -> MemoryVerdict:
    """The verdict for one load of a model (see the module docstring). `blocks`: the model's blocks with what
    of each is streamed; () where the host only predicts the load (then `why` speaks of the load alone)."""
    numbers = (f"model {_gib(memory.model_bytes)}, {_gib(memory.resident_bytes)} resident, "
               f"{_gib(memory.free_bytes)} free of a {_gib(memory.cap_bytes)} cap")
    if memory.resident_bytes >= memory.model_bytes:
        if memory.free_bytes >= memory.inference_bytes:
            return MemoryVerdict(fits=True)
        return MemoryVerdict(fits=True, cuda_graphs=False, why=(
            f"{numbers}: under the {_gib(memory.inference_bytes)} kept for one call's activations, so no whole-call "
            f"CUDA graph is recorded (its pool would hold them again); every block compiles"))
    streamed = [block for block in blocks if block.streamed_bytes > 0]
    streamed_bytes = memory.model_bytes - memory.resident_bytes
    if not blocks:
        return MemoryVerdict(fits=False, cuda_graphs=False, why=(
            f"{numbers}: the host loads {_gib(streamed_bytes)} less than the model; the blocks it streams run "
            f"eagerly through its own offload path, the resident ones compile, no whole-call CUDA graph"))
    in_blocks = sum(block.streamed_bytes for block in streamed)
    resident_blocks = len(blocks) - len(streamed)
    return MemoryVerdict(fits=False, eager_blocks=tuple(block.path for block in streamed), cuda_graphs=False, why=(
        f"{numbers}: the host streams {_gib(streamed_bytes)} per call ({_gib(in_blocks)} of it in {len(streamed)} of "
        f"{len(blocks)} blocks); those blocks run eagerly through its own offload path, the {resident_blocks} "
        f"resident ones compile as usual, no whole-call CUDA graph"))


def _gib(nbytes: int) -> str:
    """GiB with two decimals; a size under a tenth of one in MiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / 2**20:.1f} MiB"
