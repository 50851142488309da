"""kiln.compile on real diffusion architectures (diffusers, tiny configs, random weights), vs eager."""
import pytest
import torch

import kiln
from kiln.testing.models import MODELS
from kiln.compiler import PASS_NAMES
from testing_utils import rel_err

ALL_ON = {name: "on" for name in PASS_NAMES}


def _count(module, type_name):
    return sum(1 for m in module.modules() if type(m).__name__ == type_name)


@pytest.fixture(scope="module")
def sd15():
    """Tiny SD1.5 UNet compiled once through Inductor by blocks with every pass forced on and every
    region lowered whatever it measures (which regions stay compiled: tests/regional/test_region_choice.py),
    its sizes all dynamic. One compile proves every rewrite lowers in a region's graph (a block's float
    attributes, a norm's eps, stay constants). Each pass's count of every instance in one whole graph:
    tests/passes/, and test_sdxl_fast_mode_all_passes (GEGLU's, with every pass on in one whole UNet graph)."""
    spec = MODELS["sd15"]
    unet = spec.build("tiny")
    args, kwargs = spec.inputs(unet, batch=2)
    compiled = kiln.compile(unet, options=kiln.CompileOptions(mode="balanced", passes=ALL_ON, compile_unit="blocks",
                                                              measure_regions=False))
    with torch.no_grad():
        first = compiled(*args, **kwargs)[0]
    return unet, compiled, args, kwargs, first


def _compiles_one_per_region(compiled) -> bool:
    info = kiln.stats(compiled)
    return bool(info.regions) and info.compile_count == len(info.regions)


@pytest.mark.slow
def test_sd15_matches_eager_and_every_pass_fired(sd15):
    unet, compiled, args, kwargs, first = sd15
    assert rel_err(first, unet(*args, **kwargs)[0]) < 1e-4
    info = kiln.stats(compiled)
    assert _compiles_one_per_region(compiled) and not info.region_fallbacks, info.summary()
    assert all(c.lowering == "inductor" for c in info.compiles), info.summary()
    # by blocks a count is of the regions' graphs: the blocks one region holds share its one graph
    counts = dict(info.pass_counts)
    assert counts.pop("fuse_adaln_modulation") == 0  # a UNet's LayerNorms feed attention, unmodulated
    # diffusers' default attention processor calls SDPA already (the classic one's rewrite:
    # tests/passes/test_canonicalize_attention.py)
    assert counts.pop("canonicalize_attention") == 0
    assert counts.keys() == {"choose_attention_backend", "fuse_geglu", "fuse_group_norm_silu",
                             "channels_last_convs"} and all(counts.values()), counts


@pytest.mark.slow
def test_sd15_same_shapes_do_not_recompile(sd15):
    unet, compiled, args, kwargs, _ = sd15
    compiled(*args, **kwargs)
    kwargs2 = dict(kwargs, encoder_hidden_states=torch.randn_like(kwargs["encoder_hidden_states"]))  # a new prompt
    out = compiled(args[0] * 0.5, torch.full_like(args[1], 20.0), **kwargs2)[0]  # new latents, new timestep
    assert rel_err(out, unet(args[0] * 0.5, torch.full_like(args[1], 20.0), **kwargs2)[0]) < 1e-4
    assert _compiles_one_per_region(compiled)


@pytest.mark.slow
def test_sd15_weights_are_read_live(sd15):
    """In-place edits (ComfyUI's weight_inplace_update) and new Parameters (how ComfyUI installs a
    LoRA-patched weight) both show up in the compiled output, without a recompile."""
    unet, compiled, args, kwargs, first = sd15
    conv, proj = unet.conv_in, unet.down_blocks[0].attentions[0].transformer_blocks[0].ff.net[0].proj
    saved = conv.weight.detach().clone(), proj.weight
    try:
        conv.weight.mul_(1.5)
        proj.weight = torch.nn.Parameter(proj.weight + 0.05 * torch.randn_like(proj.weight), requires_grad=False)
        out = compiled(*args, **kwargs)[0]
        ref = unet(*args, **kwargs)[0]
        assert rel_err(ref, first) > 1e-2  # the patch really changes the model
        assert rel_err(out, ref) < 1e-4
        assert _compiles_one_per_region(compiled)
    finally:
        conv.weight.copy_(saved[0])
        proj.weight = saved[1]


def test_sdxl_fast_mode_all_passes():
    spec = MODELS["sdxl"]
    unet = spec.build("tiny")
    args, kwargs = spec.inputs(unet, batch=2)
    compiled = kiln.compile(unet, options=kiln.CompileOptions(mode="fast", passes=ALL_ON, compile_unit="whole"))
    assert rel_err(compiled(*args, **kwargs)[0], unet(*args, **kwargs)[0]) < 1e-4
    counts = kiln.stats(compiled).pass_counts
    assert counts["fuse_geglu"] == _count(unet, "GEGLU") > 0
    assert counts["fuse_group_norm_silu"] == 2 * _count(unet, "ResnetBlock2D") + 1


@pytest.mark.slow
def test_sd3_dit_balanced():
    """A DiT through Inductor with every pass forced on: attention is already SDPA and the
    feed-forward plain GELU, so the AdaLN modulations are what is rewritten, and Inductor lowers
    the graph around the kiln::layer_norm_modulate calls with a symbolic batch."""
    spec = MODELS["sd3"]
    dit = spec.build("tiny")
    args, kwargs = spec.inputs(dit, batch=2)
    compiled = kiln.compile(dit, options=kiln.CompileOptions(mode="balanced", passes=ALL_ON))
    assert rel_err(compiled(*args, **kwargs)[0], dit(*args, **kwargs)[0]) < 1e-4
    args3, kwargs3 = spec.inputs(dit, batch=3)
    assert rel_err(compiled(*args3, **kwargs3)[0], dit(*args3, **kwargs3)[0]) < 1e-4
    info = kiln.stats(compiled)
    assert info.compile_count == 1
    counts = dict(info.pass_counts)
    assert counts.pop("choose_attention_backend") >= _count(dit, "JointTransformerBlock")  # its SDPA calls: math on a CPU
    assert counts == {
        "canonicalize_attention": 0, "fuse_geglu": 0, "fuse_group_norm_silu": 0,
        "fuse_adaln_modulation": 4 * _count(dit, "JointTransformerBlock"),
        "channels_last_convs": 1,  # the patch embedding
    }


def test_flux_fast():
    spec = MODELS["flux"]
    dit = spec.build("tiny")
    args, kwargs = spec.inputs(dit, batch=1)
    compiled = kiln.compile(dit, mode="fast")
    assert rel_err(compiled(*args, **kwargs)[0], dit(*args, **kwargs)[0]) < 1e-4
    assert kiln.stats(compiled).compile_count >= 1


def test_same_module_and_options_reuse_the_compiled_module():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    a = kiln.compile(module, mode="fast")
    assert kiln.compile(module, mode="fast") is a
    assert kiln.compile(module, mode="balanced") is not a


def test_stats_of_something_else_is_an_error():
    with pytest.raises(ValueError, match="not returned by kiln.compile"):
        kiln.stats(torch.nn.Linear(2, 2))
