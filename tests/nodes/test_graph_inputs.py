"""ComfyUI's transformer_options as a whole-call recording reads it (nodes/graph_inputs.py)."""
import torch

from kiln.compiler.graphs.recording_key import recording_key
from kiln.nodes.block_inputs import ComfyBlockInputs
from kiln.nodes.graph_inputs import GRAPH_SAFE, fingerprint, unsafe_patches, weights_note


def freeu_like():
    def output_block_patch(h, hsp, transformer_options):
        return h, hsp
    output_block_patch.__module__ = "comfy_extras.nodes_freelunch"
    output_block_patch.__qualname__ = "FreeU.patch.<locals>.output_block_patch"
    return output_block_patch


class IPAdapterAttn:
    def __call__(self, q, k, v, extra_options):
        return q


def options(**extra):
    return {"cond_or_uncond": [1, 0], "sigmas": torch.ones(2), "patches": {}, "uuids": ["a", "b"], **extra}


def test_only_comfyuis_options_are_fingerprinted():
    assert fingerprint({"x": 1}) is None and fingerprint(torch.ones(1)) is None
    assert fingerprint(options()) == fingerprint(options(uuids=["c", "d"]))  # read by no model code
    assert fingerprint(options()) != fingerprint(options(cond_or_uncond=[0]))
    patched = options(patches={"output_block_patch": [freeu_like()]})
    assert fingerprint(patched) != fingerprint(options())
    assert fingerprint(patched) != fingerprint(options(patches={"output_block_patch": [freeu_like()]}))  # another id


def test_the_graph_safe_list():
    freeu = options(patches={"output_block_patch": [freeu_like()]})
    assert "comfy_extras.nodes_freelunch:FreeU.patch.<locals>.output_block_patch" in GRAPH_SAFE
    assert unsafe_patches(freeu) == ()
    ipadapter = options(patches_replace={"attn2": {("input", 4, 0): IPAdapterAttn()}})
    assert unsafe_patches(ipadapter) == (f"patches_replace.attn2 {__name__}:IPAdapterAttn",)
    wrapped = options(wrappers={"diffusion_model": {"step_cache": [print]}, "apply_model": {"kiln": [len]}})
    assert unsafe_patches(wrapped) == ("wrappers.diffusion_model builtins:print",)  # apply_model runs outside


def test_low_vram_layers_are_named():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert weights_note(net) == ""
    net[1].comfy_cast_weights = True
    assert "casts or patches 1's weights" in weights_note(net)


def test_the_key_reads_the_options_through_the_hook():
    net = torch.nn.Linear(2, 2)
    host = ComfyBlockInputs()
    key = recording_key(net, (torch.ones(2, 2),), {"transformer_options": options()}, host)
    assert any(spec.place == "kwargs['transformer_options']['sigmas']" for spec in key.tensors)
    assert len(key.host) == 1 and host.graph_unsafe(options()) == ()
