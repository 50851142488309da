"""Kiln's DiT rewrite on ComfyUI's own Flux transformer (comfy.ldm.flux.model.Flux), whose AdaLN
is spelled `addcmul(shift, norm(x), 1 + scale)` rather than diffusers' `norm(x) * (1 + scale) + shift`.
Runs when COMFYUI_PATH points at a ComfyUI tree; skips otherwise."""
import os

import pytest
import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH or not os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    pytest.skip("COMFYUI_PATH is not set to a ComfyUI tree", allow_module_level=True)
pytest.importorskip("comfy.model_management")  # conftest.py put COMFYUI_PATH on the path and set ComfyUI's args

import comfy.ldm.flux.model  # noqa: E402
import comfy.ops  # noqa: E402

import kiln  # noqa: E402
from testing_utils import rel_err  # noqa: E402

TINY_FLUX = dict(  # Flux's layout (double blocks, then single blocks), scaled down
    in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, hidden_size=32, mlp_ratio=2.0, num_heads=2,
    depth=1, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True,
    guidance_embed=False, txt_ids_dims=[],
)


def tiny_flux():
    torch.manual_seed(0)
    model = comfy.ldm.flux.model.Flux(operations=comfy.ops.disable_weight_init, **TINY_FLUX)
    for p in model.parameters():  # disable_weight_init leaves them uninitialised
        p.data.normal_(0, 0.05)
    return model.eval().requires_grad_(False)


def flux_inputs(batch, side=8):
    torch.manual_seed(1)
    return (torch.randn(batch, 4, side, side), torch.full((batch,), 0.5), torch.randn(batch, 7, 32),
            torch.randn(batch, 16))


def test_comfy_flux_adaln_is_fused_and_matches_eager():
    model = tiny_flux()
    compiled = kiln.compile(model, options=kiln.CompileOptions(mode="fast", passes={"fuse_adaln_modulation": "on"},
                                                               compile_unit="whole"))  # every norm in one graph
    for batch in (2, 3):
        x, t, context, y = flux_inputs(batch)
        # a fresh transformer_options per call, as ComfyUI's sampler passes (Flux writes into it;
        # its default {} would carry the last call's keys and fail a guard)
        out = compiled(x, t, context, y=y, transformer_options={})
        assert rel_err(out, model(x, t, context, y=y, transformer_options={})) < 1e-5
    info = kiln.stats(compiled)
    double, single = TINY_FLUX["depth"], TINY_FLUX["depth_single_blocks"]
    # each double block modulates img and txt before attention and before the MLP; a single block
    # once; the last layer once
    assert info.pass_counts["fuse_adaln_modulation"] == 4 * double + single + 1
    assert info.compile_count == 1


def test_comfy_flux_compiles_by_blocks_and_matches_eager():
    """ComfyUI's Flux by blocks: its identical single blocks share one graph; new batches and sizes
    compile nothing."""
    model = tiny_flux()
    compiled = kiln.compile(model, mode="fast")
    for batch, side in ((2, 8), (3, 8), (2, 12)):
        x, t, context, y = flux_inputs(batch, side)
        out = compiled(x, t, context, y=y, transformer_options={})
        assert rel_err(out, model(x, t, context, y=y, transformer_options={})) < 1e-4
    info = kiln.stats(compiled)
    assert [(r.name, len(r.members)) for r in info.regions] == [("DoubleStreamBlock#1", 1), ("SingleStreamBlock#1", 2)]
    assert info.compile_count == 2 and not info.recompiles and info.eager_calls == 0, info.summary()


def test_comfy_flux_glue_compiles_as_regions_of_its_own_and_matches_eager():
    """glue_regions on: ComfyUI's Flux embedders and final layer are regions of their own (img_in and txt_in,
    lone layers, stay eager); new batches and sizes compile nothing more."""
    model = tiny_flux()
    compiled = kiln.compile(model, options=kiln.CompileOptions(mode="fast", glue_regions="on", measure_regions=False))
    graphs = None
    for batch, side in ((2, 8), (3, 8), (2, 12)):
        x, t, context, y = flux_inputs(batch, side)
        out = compiled(x, t, context, y=y, transformer_options={})
        assert rel_err(out, model(x, t, context, y=y, transformer_options={})) < 1e-4
        graphs = graphs or kiln.stats(compiled).compile_count
    info = kiln.stats(compiled)
    assert [r.members for r in info.regions if r.glue] == [("pe_embedder",), ("time_in",), ("vector_in",), ("final_layer",)]
    assert info.compile_count == graphs and not info.recompiles and not info.region_fallbacks, info.summary()
