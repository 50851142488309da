"""Helpers for the tests that run on ComfyUI's own classes (tests/comfyui/): import this only after
checking COMFYUI_PATH, as those test modules do."""
import comfy.model_base
import comfy.model_patcher
import comfy.sample
import comfy.supported_models
import torch

TINY_SD15 = dict(  # ComfyUI's SD1.5 UNet layout, scaled down
    image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1, channel_mult=[1, 2],
    transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
    transformer_depth_middle=1, use_spatial_transformer=True, context_dim=32, use_linear_in_transformer=False,
    adm_in_channels=None, use_temporal_attention=False, legacy=False,
)


# The smallest layout ComfyUI's model detection still reads as SD1.5 (a "tiny" random-weight checkpoint):
# for tests that save a model and load it back through ComfyUI's loaders.
DETECTABLE_SD15 = dict(
    image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[1, 1], channel_mult=[1, 2],
    transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1,
    use_spatial_transformer=True, legacy=False, use_linear_in_transformer=False, context_dim=768, num_heads=8,
    num_head_channels=-1, adm_in_channels=None, use_temporal_resblock=False, use_temporal_attention=False,
)


def make_tiny_sd15_patcher(seed: int = 0, unet_config=TINY_SD15):
    torch.manual_seed(seed)
    config = comfy.supported_models.SD15(dict(unet_config))
    model = comfy.model_base.BaseModel(config, device=torch.device("cpu"))
    for p in model.parameters():  # random weights at a sane scale
        p.data.normal_(0, 0.05)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def sample(patcher, batch=1, seed=3, size=16, steps=2, width=None):
    torch.manual_seed(seed)
    latent = torch.zeros(batch, 4, size, width or size)
    noise = torch.randn(batch, 4, size, width or size)
    context = patcher.model.model_config.unet_config["context_dim"]
    pos, neg = [[torch.randn(1, 7, context), {}]], [[torch.randn(1, 7, context), {}]]
    return comfy.sample.sample(patcher, noise, steps, 7.0, "euler", "normal", pos, neg, latent, disable_pbar=True, seed=seed)


def lora_like_patches(patcher, scale=0.2, seed=5):
    """A 'diff' patch on every attention projection: what a LoRA loader adds."""
    gen = torch.Generator().manual_seed(seed)
    sd = patcher.model.state_dict()
    return {k: (torch.randn(sd[k].shape, generator=gen) * scale,) for k in sd if k.endswith(("to_q.weight", "to_v.weight"))}


def controlnet_network(unet_config, seed: int, std: float):
    """ComfyUI's ControlNet module of a UNet layout, random weights at the given scale."""
    import comfy.cldm.cldm

    config = {k: v for k, v in unet_config.items()
              if k not in ("out_channels", "transformer_depth_output", "use_temporal_attention", "use_temporal_resblock")}
    config.setdefault("num_heads", 8)
    torch.manual_seed(seed)
    network = comfy.cldm.cldm.ControlNet(hint_channels=3, **config)
    for p in network.parameters():  # ComfyUI's ops leave weights uninitialised; the zero convs too
        p.data.normal_(0, std)
    return network


def save_tiny_controlnet(path, seed=0):
    """A random-weight SD1.5 ControlNet that ComfyUI's ControlNetLoader reads (original layout, the
    DETECTABLE_SD15 size), saved as a plain tensor dict (a .pth, as users' files are named)."""
    network = controlnet_network(DETECTABLE_SD15, seed, std=0.02)
    torch.save({"control_model." + k: v.contiguous() for k, v in network.state_dict().items()}, path)


def make_tiny_controlnet(unet_config=TINY_SD15, seed=7):
    """A random-weight ControlNet of the tiny UNet's layout, as ComfyUI's ControlNetLoader returns one."""
    import comfy.controlnet

    return comfy.controlnet.ControlNet(controlnet_network(unet_config, seed, std=0.05), load_device=torch.device("cpu"))


def kiln_stats(model):
    """The stats of the KilnModel that Kiln's wrapper on `model` (a MODEL a Kiln node returned) runs."""
    from kiln.compiler import model_for
    from kiln.nodes.plan_wrapper import WRAPPER_KEY

    wrapper = model.get_wrappers("apply_model", WRAPPER_KEY)[0]
    return model_for(model.get_model_object("diffusion_model"), wrapper.plan).stats


# ComfyUI's per-layer quantized formats as its own quantizers write them: format -> (stored dtype, largest stored value)
COMFY_FORMATS = {"float8_e4m3fn": (torch.float8_e4m3fn, 448.0), "float8_e5m2": (torch.float8_e5m2, 57344.0),
                 "int8_tensorwise": (torch.int8, 127.0)}


def comfy_quantized(state_dict: dict, file_format: str, per_row: bool = False, stored=None) -> dict:
    """A diffusion model's state dict with every Linear (2-D) weight in ComfyUI's per-layer format `file_format`:
    <layer>.weight stored, <layer>.weight_scale float32 (0-dim, or (out, 1) with `per_row`), <layer>.comfy_quant.
    `stored`: (dtype, largest value) for a format not in COMFY_FORMATS."""
    import json

    dtype, largest = stored or COMFY_FORMATS[file_format]
    marker = torch.tensor(list(json.dumps({"format": file_format}).encode()), dtype=torch.uint8)
    out = {}
    for key, value in state_dict.items():
        if not (key.endswith(".weight") and value.dim() == 2):
            out[key] = value.contiguous()
            continue
        layer = key[:-len(".weight")]
        weight = value.float()
        scale = ((weight.abs().amax(dim=1, keepdim=True) if per_row else weight.abs().amax()) / largest).clamp_min(1e-12)
        scaled = weight / scale
        out[key] = (scaled.round() if dtype == torch.int8 else scaled).clamp(-largest, largest).to(dtype)
        out[f"{layer}.weight_scale"] = scale
        out[f"{layer}.comfy_quant"] = marker.clone()
    return out


EVERY_REGION = "measure_regions: false"


def compile_unet(model, mode="fast", advanced="", **inputs):
    """Kiln › Compile UNet with every region with something to fuse compiled, whatever it measures:
    these tests check what runs through compiled regions (on a CPU most regions measure no faster
    and would run eagerly; the measured choice has tests of its own)."""
    from kiln.nodes.compile_unet import KilnCompileUNet

    return KilnCompileUNet().compile(model, mode=mode, advanced="\n".join(filter(None, (EVERY_REGION, advanced))),
                                     **inputs)

