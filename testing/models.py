"""Real diffusion architectures (diffusers) with random weights, at tiny, CPU-bench and full size.

`MODELS[name].build(size)` returns the module in eval mode; `.inputs(module, batch, ...)` the
(args, kwargs) of one denoising step with CFG folded into the batch. No weights are downloaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

SIZES = ("tiny", "cpu", "full")


def _sd15_config(size: str) -> dict:
    channels = {"tiny": (32, 64), "cpu": (32, 64, 128, 128), "full": (320, 640, 1280, 1280)}[size]
    n = len(channels)
    return dict(
        sample_size={"tiny": 8, "cpu": 32, "full": 64}[size], in_channels=4, out_channels=4,
        layers_per_block={"tiny": 1, "cpu": 2, "full": 2}[size], block_out_channels=channels,
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        cross_attention_dim={"tiny": 32, "cpu": 128, "full": 768}[size], attention_head_dim=8,
        norm_num_groups=32 if size != "tiny" else 8,
    )


def _sdxl_config(size: str) -> dict:
    channels = {"tiny": (32, 64, 64), "cpu": (64, 128, 256), "full": (320, 640, 1280)}[size]
    text = {"tiny": 32, "cpu": 128, "full": 2048}[size]
    return dict(
        sample_size={"tiny": 8, "cpu": 32, "full": 128}[size], in_channels=4, out_channels=4, layers_per_block=2 if size != "tiny" else 1,
        block_out_channels=channels, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block={"tiny": (1, 1, 2), "cpu": (1, 2, 2), "full": (1, 2, 10)}[size],
        attention_head_dim={"tiny": (2, 4, 4), "cpu": (2, 4, 8), "full": (5, 10, 20)}[size],
        cross_attention_dim=text, use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim={"tiny": 8, "cpu": 32, "full": 256}[size],
        projection_class_embeddings_input_dim={"tiny": 8 * 6 + 32, "cpu": 32 * 6 + 128, "full": 2816}[size],
        norm_num_groups=32 if size != "tiny" else 8,
    )


def _latent_hw(latent, default: int) -> tuple[int, int]:
    """`latent`: 0 (the model's default), a side, or (height, width)."""
    if isinstance(latent, (tuple, list)):
        return int(latent[0]), int(latent[1])
    return (latent or default,) * 2


def _unet_inputs(module, batch: int, device, dtype, latent=0, context_len: int = 77):
    cfg = module.config
    height, width = _latent_hw(latent, cfg.sample_size)
    x = torch.randn(batch, cfg.in_channels, height, width, device=device, dtype=dtype)
    t = torch.full((batch,), 500.0, device=device)
    ctx = torch.randn(batch, context_len, cfg.cross_attention_dim, device=device, dtype=dtype)
    kwargs = {"encoder_hidden_states": ctx, "return_dict": False}
    if cfg.addition_embed_type == "text_time":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, pooled, device=device, dtype=dtype),
            "time_ids": torch.tensor([[height * 8, width * 8, 0, 0, height * 8, width * 8]] * batch, device=device, dtype=dtype),
        }
    return (x, t), kwargs


def _sd3_config(size: str) -> dict:
    if size == "full":
        return dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                    pooled_projection_dim=2048, out_channels=16)
    width = {"tiny": 2, "cpu": 4}[size]
    return dict(sample_size={"tiny": 8, "cpu": 32}[size], patch_size=2, in_channels=4, num_layers=2 if size == "tiny" else 4,
                attention_head_dim=16, num_attention_heads=width, joint_attention_dim=32, caption_projection_dim=16 * width,
                pooled_projection_dim=32, out_channels=4)


def _flux_config(size: str) -> dict:
    if size == "full":
        return dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                    axes_dims_rope=(16, 56, 56))
    # cpu: Flux's shape in small, many identical double and single blocks (what compiling by blocks is for)
    return dict(patch_size=1, in_channels=16, num_layers=1 if size == "tiny" else 6,
                num_single_layers=2 if size == "tiny" else 12,
                attention_head_dim=16, num_attention_heads=2 if size == "tiny" else 4, joint_attention_dim=32,
                pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))


def _sd3_inputs(module, batch: int, device, dtype, latent: int = 0, context_len: int = 77):
    cfg = module.config
    size = latent or cfg.sample_size
    return (), {
        "hidden_states": torch.randn(batch, cfg.in_channels, size, size, device=device, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, context_len, cfg.joint_attention_dim, device=device, dtype=dtype),
        "pooled_projections": torch.randn(batch, cfg.pooled_projection_dim, device=device, dtype=dtype),
        "timestep": torch.full((batch,), 500.0, device=device), "return_dict": False,
    }


def _flux_inputs(module, batch: int, device, dtype, latent=0, context_len: int = 0):
    """`latent`: the packed (2x2) latent's side or (height, width); 0: 64 at full size (1024 px), else 8."""
    cfg = module.config
    height, width = _latent_hw(latent, {16: 8, 64: 64}.get(cfg.in_channels, 8))
    context_len = context_len or (512 if cfg.in_channels == 64 else 7)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(height).float(), torch.arange(width).float(), indexing="ij"), -1)
    kwargs = {
        "hidden_states": torch.randn(batch, height * width, cfg.in_channels, device=device, dtype=dtype),
        "encoder_hidden_states": torch.randn(batch, context_len, cfg.joint_attention_dim, device=device, dtype=dtype),
        "pooled_projections": torch.randn(batch, cfg.pooled_projection_dim, device=device, dtype=dtype),
        "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),
        "img_ids": img_ids.reshape(-1, 3).to(device=device, dtype=dtype),
        "txt_ids": torch.zeros(context_len, 3, device=device, dtype=dtype), "return_dict": False,
    }
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full((batch,), 3.5, device=device, dtype=dtype)
    return (), kwargs


def _vae_config(size: str) -> dict:
    channels = {"tiny": (32, 32), "cpu": (32, 64, 64), "full": (128, 256, 512, 512)}[size]
    n = len(channels)
    return dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=channels, layers_per_block=2 if size == "full" else 1,
                down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
                norm_num_groups=32 if size == "full" else 8, sample_size={"tiny": 32, "cpu": 64, "full": 1024}[size])


class VAEDecode(torch.nn.Module):
    """`vae.decode(z)` as a module (what ComfyUI's VAE Decode runs), so it can be compiled alone."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae
        self.config = vae.config

    def forward(self, z, return_dict: bool = False):
        return (self.vae.decode(z).sample,)


def _vae_inputs(module, batch: int, device, dtype, latent: int = 0, context_len: int = 0):
    side = latent or module.config.sample_size // 2 ** (len(module.config.block_out_channels) - 1)
    return (torch.randn(batch, module.config.latent_channels, side, side, device=device, dtype=dtype),), {}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    config: Callable[[str], dict]
    cls_name: str
    make_inputs: Callable

    def build(self, size: str = "tiny", dtype=torch.float32, device="cpu", seed: int = 0) -> torch.nn.Module:
        import diffusers

        torch.manual_seed(seed)
        module = getattr(diffusers, self.cls_name)(**self.config(size))
        if self.cls_name == "AutoencoderKL":
            module = VAEDecode(module)
        module = module.to(device=device) if dtype == torch.float32 else module.to(device=device, dtype=dtype)
        return module.eval().requires_grad_(False)

    def inputs(self, module, batch: int = 2, device="cpu", dtype=torch.float32, seed: int = 1, **shape):
        torch.manual_seed(seed)
        return self.make_inputs(module, batch, device, dtype, **shape)


MODELS = {
    "sd15": ModelSpec("sd15", "SD1.5 UNet (UNet2DConditionModel)", _sd15_config, "UNet2DConditionModel", _unet_inputs),
    "sdxl": ModelSpec("sdxl", "SDXL UNet (UNet2DConditionModel, text_time)", _sdxl_config, "UNet2DConditionModel", _unet_inputs),
    "sd3": ModelSpec("sd3", "SD3 MMDiT (SD3Transformer2DModel)", _sd3_config, "SD3Transformer2DModel", _sd3_inputs),
    "vae": ModelSpec("vae", "SD VAE decoder (AutoencoderKL.decode)", _vae_config, "AutoencoderKL", _vae_inputs),
    "flux": ModelSpec("flux", "Flux transformer (FluxTransformer2DModel)", _flux_config, "FluxTransformer2DModel", _flux_inputs),
}
