"""ComfyUI's transformer_options as the compiler reads them (nodes/block_inputs.py, registered by Kiln's
nodes): identical blocks told their position share one compiled code; what a block writes into the
dict reaches the caller; a block calling patches with its position gets the real one; the sigma
schedule's length is dynamic. The autouse fixture of tests/nodes registers the convention."""
import torch

import kiln
from kiln.compiler import CompileOptions, HostInputs, host_inputs
from kiln.compiler.regional.block_positions import positions_hidden
from kiln.nodes.block_inputs import POSITION_KEYS, ComfyBlockInputs


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, transformer_options=None):
        for patch in transformer_options.get("patches", {}).get("attn1_patch", []):
            x = patch(x, transformer_options["block"])
        transformer_options["seen_by_block"] = True
        transformer_options["activations_shape"] = list(x.shape)
        return torch.nn.functional.gelu(self.proj(x)) + x


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x, transformer_options):
        for index, block in enumerate(self.blocks):
            transformer_options["block"] = ("input", index)
            transformer_options["block_index"] = index
            x = block(x, transformer_options=transformer_options)
        return x


def test_kilns_nodes_register_comfyuis_conventions():
    assert isinstance(host_inputs(), ComfyBlockInputs)


def test_identical_blocks_told_their_position_share_one_graph_and_what_they_write_comes_back():
    torch.manual_seed(0)
    module, x = Net().eval(), torch.randn(2, 4, 8)
    compiled = kiln.compile(module, options=CompileOptions(mode="fast", compile_unit="blocks", measure_regions=False))
    options = {"seen_by_block": False}
    with torch.no_grad():
        out = compiled(x, options)
    assert torch.allclose(out, module(x, {"seen_by_block": False}), atol=1e-6)
    info = kiln.stats(compiled)
    assert info.compile_count == 1 and not info.fallback  # one graph for three positions
    assert options["seen_by_block"] is True and options["block"] == ("input", 2)  # the caller's own dict, written
    assert "activations_shape" not in options  # a key blocks write for patches: left out with no patch


def test_a_block_calling_a_patch_with_its_position_gets_the_real_one():
    torch.manual_seed(0)
    module, x = Net().eval(), torch.randn(2, 4, 8)
    compiled = kiln.compile(module, options=CompileOptions(mode="fast", compile_unit="blocks", measure_regions=False))
    seen = []

    def patch(h, where):
        seen.append(where)
        return h * (1.0 + where[1])

    with torch.no_grad():
        out = compiled(x, {"patches": {"attn1_patch": [patch]}})
    assert torch.allclose(out, module(x, {"patches": {"attn1_patch": [patch]}}), atol=1e-5)
    assert ("input", 2) in seen


def test_the_convention_hides_only_what_says_where_a_block_sits():
    host = ComfyBlockInputs()
    options = {"block": ("output", 3), "block_index": 3, "activations_shape": [1], "cond_or_uncond": [0, 1]}
    assert host.carries_position(options) and not host.carries_position({"cond_or_uncond": [0]})
    assert not host.calls_position_patches(options)
    assert host.calls_position_patches({"block": ("input", 1), "patches_replace": {"attn1": {}}})
    copy = host.without_position(options)
    assert {key: copy[key] for key in POSITION_KEYS} == POSITION_KEYS and "activations_shape" not in copy
    assert copy["cond_or_uncond"] == [0, 1] and options["block"] == ("output", 3)  # the original untouched
    sigmas = torch.linspace(1, 0, 5)
    assert host.schedule_in({"sample_sigmas": sigmas}) is sigmas and host.schedule_in({"x": 1}) is None


def test_the_plain_host_hides_nothing():
    options = {"block": ("input", 1)}
    host = HostInputs()
    assert not host.carries_position(options) and host.schedule_in({"sample_sigmas": torch.ones(3)}) is None
    from kiln.compiler import use_host_inputs

    use_host_inputs(host)
    with positions_hidden((options,), {}) as (args, kwargs):
        assert args[0] is options
