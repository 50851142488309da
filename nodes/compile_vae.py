"""Kiln › Compile VAE: VAE in, VAE out whose decode and/or encode run compiled (VAE Decode, VAE Decode
(Tiled), VAE Encode and every node that decodes or encodes through it).

The VAE given is unchanged: the node returns a copy whose ModelPatcher is a clone carrying ComfyUI
object patches of `decode` / `encode` on the VAE's model, so the compiled methods are installed
only while that copy is loaded, as core's own compile node does for the diffusion model. The
weights stay the VAE's own. Tiles and image sizes after the first run on the same dynamic graph.
"""
from __future__ import annotations

import copy
import logging

from . import plan_wrapper, shared

log = logging.getLogger("kiln")

PARTS = {"decode": ("decode",), "encode": ("encode",), "decode and encode": ("decode", "encode")}


class KilnCompileVAE:
    DESCRIPTION = ("Compiles the VAE's decode and/or encode with Kiln on first use, tiled decode included. "
                   "The VAE given is unchanged; the one returned runs compiled.")
    CATEGORY = "Kiln"
    FUNCTION = "compile"
    RETURN_TYPES = ("VAE", "STRING")
    RETURN_NAMES = ("vae", "report")
    OUTPUT_TOOLTIPS = ("the VAE, compiled on its first decode or encode", "what Kiln will do (or why it runs eagerly)")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae": ("VAE",),
                "mode": shared.mode_widget(),
                "compile": (list(PARTS), {"default": "decode", "tooltip":
                            "which of the VAE's methods to compile: decode (txt2img), encode (img2img, inpaint) or both"}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},  # the node shows each compile as it happens
        }

    def compile(self, vae, mode="balanced", compile="decode", unique_id=None):
        from ..loaded import COMPILER_LOAD_ERROR, compiler

        if compiler is None:
            return shared.eager(vae, COMPILER_LOAD_ERROR, "the VAE")
        # whole: by blocks is measured and tested on diffusion models (docs/compile-units.md), not yet on VAEs
        options = compiler.build_options(mode, compile_unit="whole").compile  # a bad option raises, naming it
        if compiler.unavailable_reason():
            return shared.eager(vae, compiler.unavailable_reason(), "the VAE")
        module = getattr(vae, "first_stage_model", None)
        if module is None:
            raise RuntimeError("Kiln › Compile VAE: this VAE has no weights (its loader found no VAE in the file)")
        plan = compiler.KilnPlan(compile=options)
        compiled = copy.copy(vae)
        compiled.patcher = vae.patcher.clone()
        for method in PARTS[compile]:
            kiln_model = compiler.model_for(compiler.method_module(module, method), plan,
                                            progress=plan_wrapper.progress_bar())
            if kiln_model.stats.fallback:  # this VAE already failed to compile under these options
                return shared.eager(vae, kiln_model.stats.fallback, "the VAE")
            compiled.patcher.add_object_patch(method, plan_wrapper.ShowCompiles(kiln_model, str(unique_id or "")))
        report = (f"Kiln will compile {type(module).__name__}'s {' and '.join(PARTS[compile])} on first use: "
                  f"{plan.describe()}. Other image and tile sizes run on the same dynamic graph.")
        log.info(report)
        return (compiled, report)


NODE_CLASS_MAPPINGS = {"KilnCompileVAE": KilnCompileVAE}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnCompileVAE": "Kiln › Compile VAE"}
