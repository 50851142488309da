"""Helpers shared by the tests (tests/ is on pytest's pythonpath)."""
import os

import torch

from kiln.testing.image_quality import psnr  # noqa: F401  the tests' image comparison

# Where the Triton kernel tests run: CPU tensors through Triton's interpreter (CI, the default set
# in conftest.py), or CUDA with Triton compiling for real when run on a GPU with TRITON_INTERPRET=0.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
# A Triton kernel's tl.dot on fp32 tiles: exact fp32 in the interpreter, TF32 (a 10-bit mantissa, as
# torch's matmul with allow_tf32) on a CUDA GPU, the default input_precision there.
FP32_DOT_TOL = 1e-5 if KERNEL_DEVICE == "cpu" else 2e-3


def fake_caches_of(gm: torch.fx.GraphModule, example_inputs) -> set:
    """Whether the fake tensors behind a captured graph cache their dispatches: TorchDynamo's own
    (its placeholders' example values) and those AOTAutograd and Inductor go on with (the tracing
    context's). A set of the flags seen."""
    seen = {torch._guards.detect_fake_mode(example_inputs).cache_enabled}
    seen.update(node.meta["example_value"].fake_mode.cache_enabled for node in gm.graph.find_nodes(op="placeholder")
                if isinstance(node.meta.get("example_value"), torch.Tensor))
    return seen


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute difference relative to the reference's max magnitude."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class TwoRegionNet(torch.nn.Module):
    """Six identical blocks, then two of another width: two regions, Block#1 called first (the tests of
    compiling by blocks, tests/regional/test_regional_compile.py and test_background.py)."""

    def __init__(self):
        super().__init__()
        self.embed, self.up, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(6))
        self.wide = torch.nn.ModuleList(Block(32) for _ in range(2))

    def forward(self, image):
        x = self.embed(image.flatten(2).transpose(1, 2))  # (batch, height x width, 8): tokens follow the resolution
        for block in self.blocks:
            x = block(x)
        x = self.up(x)
        for block in self.wide:
            x = block(x)
        return self.out(x).transpose(1, 2).reshape(image.shape)


def two_region_net() -> TwoRegionNet:
    torch.manual_seed(0)
    return TwoRegionNet().eval()


def fail_lowering_of_width(monkeypatch, width: int) -> None:
    """Kiln's lowering raises "lowering exploded" for a graph with an input `width` wide (in
    TwoRegionNet: 32, its second region) and lowers the others as before."""
    from kiln.compiler.backend import lowering as lowering_module

    real = lowering_module.lower_graph

    def lower(self, gm, example_inputs, *args, **kwargs):
        if any(isinstance(a, torch.Tensor) and a.dim() and a.shape[-1] == width for a in example_inputs):
            raise RuntimeError("lowering exploded")
        return real(self, gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(lowering_module, "lower_graph", lower)


def answer_region_timings(monkeypatch, answers: list) -> list:
    """Each region timing the region choice asks for is the next of `answers` (RegionTiming's fields); both
    sides still run once, as a timing would. Returns the list the devices asked for are appended to."""
    from kiln.compiler.regional import region_choice
    from kiln.compiler.regional.region_choice import RegionTiming, fresh_copies

    devices = []

    def fake(compiled, eager, args, kwargs, device, rounds=region_choice.ROUNDS):
        devices.append(device)
        compiled(*fresh_copies(args, kwargs))
        eager(*fresh_copies(args, kwargs))
        return RegionTiming(*answers.pop(0))

    monkeypatch.setattr(region_choice, "time_both", fake)
    return devices
