"""compiler/host_layers.py: a host's layer TorchDynamo cannot trace runs its traceable stand-in while a
compiled call runs (by blocks and whole), so its region compiles; outside the call the layer is the host's."""
import pytest
import torch

import kiln
from kiln.compiler import CompileOptions, HostLayers, use_host_layers
from kiln.compiler.host_layers import stand_ins


class HostLinear(torch.nn.Linear):
    """A host's layer whose forward TorchDynamo cannot capture (as ComfyUI 0.33's fp8 Linear)."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            raise RuntimeError("this layer cannot be traced")
        return super().forward(x)


def traceable(layer, x):
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


class Host(HostLayers):
    def traceable_forward(self, layer):
        return traceable if isinstance(layer, HostLinear) else None


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = HostLinear(16, 16)

    def forward(self, x):
        return x + torch.relu(self.proj(x))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture
def host():
    use_host_layers(Host())
    yield
    use_host_layers(HostLayers())


def test_stand_ins_are_set_inside_and_removed_after(host):
    model = Model()
    with stand_ins(model) as count:
        assert count == 3 and all("forward" in b.proj.__dict__ for b in model.blocks)
    assert all("forward" not in b.proj.__dict__ for b in model.blocks)


def test_a_layer_with_its_own_instance_forward_is_left_alone(host):
    model = Model()
    mine = model.blocks[0].proj.forward
    model.blocks[0].proj.forward = mine
    with stand_ins(model) as count:
        assert count == 2 and model.blocks[0].proj.__dict__["forward"] is mine
    assert model.blocks[0].proj.__dict__["forward"] is mine


@pytest.mark.parametrize("unit", ["blocks", "whole"])
def test_the_region_holding_the_layer_compiles(host, unit):
    torch.manual_seed(0)
    model = Model()
    compiled = kiln.compile(model, CompileOptions(mode="fast", compile_unit=unit, measure_regions=False))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        assert compiled(torch.randn(3, 7, 16)).shape == (3, 7, 16)
    info = kiln.stats(compiled)
    assert not info.fallback and not info.region_fallbacks and info.eager_calls == 0, info.summary()
    assert info.compile_count >= 1
    assert all("forward" not in b.proj.__dict__ for b in model.blocks)


def test_without_the_hook_the_region_runs_eagerly():
    """What the hook is for: the same model with no stand-in cannot be captured: nothing compiles."""
    model = Model()
    compiled = kiln.compile(model, CompileOptions(mode="fast", compile_unit="blocks", measure_regions=False))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    info = kiln.stats(compiled)
    assert info.compile_count == 0 and (info.eager_calls or info.region_fallbacks), info.summary()
