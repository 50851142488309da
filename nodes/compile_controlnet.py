"""Kiln › Compile ControlNet: CONTROL_NET in, CONTROL_NET out whose control model runs compiled.

The ControlNet given is unchanged: the node returns ComfyUI's own copy of it with its
`control_model` replaced by Kiln's compiled model (which reads the original's live weights; the
copy keeps the original's ModelPatcher for loading and offloading). Apply ControlNet nodes copy it
again and keep the compiled model, so strength and hint changes do not recompile. Control LoRA and
T2I-Adapter models build or run their networks differently: they pass through eagerly, said so.
"""
from __future__ import annotations

import logging

from . import plan_wrapper, shared
from .shared import DYNAMIC

log = logging.getLogger("kiln")


class KilnCompileControlNet:
    DESCRIPTION = ("Compiles a ControlNet's network with Kiln on its first sampling step. Strength changes "
                   "(0 included) and new hints do not recompile.")
    CATEGORY = "Kiln"
    FUNCTION = "compile"
    RETURN_TYPES = ("CONTROL_NET", "STRING")
    RETURN_NAMES = ("control_net", "report")
    OUTPUT_TOOLTIPS = ("the ControlNet, compiled on first use", "what Kiln will do (or why it runs eagerly)")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "control_net": ("CONTROL_NET",),
                "mode": shared.mode_widget(),
                "dynamic": (list(DYNAMIC), {"default": "auto", "tooltip":
                            "auto: batch and resolution dynamic from the first compile; true: all dynamic; false: specialise"}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},  # the node shows each compile as it happens
        }

    def compile(self, control_net, mode="balanced", dynamic="auto", unique_id=None):
        from ..loaded import COMPILER_LOAD_ERROR, compiler

        if compiler is None:
            return shared.eager(control_net, COMPILER_LOAD_ERROR, "the ControlNet")
        # whole: by blocks is measured and tested on diffusion models (docs/compile-units.md), not yet on ControlNets
        options = compiler.build_options(mode, DYNAMIC[dynamic], compile_unit="whole").compile  # a bad option raises, naming it
        unsupported = compiler.unavailable_reason() or unsupported_reason(control_net)
        if unsupported:
            return shared.eager(control_net, unsupported, "the ControlNet")
        network = control_net.control_model
        if isinstance(network, plan_wrapper.ShowCompiles):  # compiled before: compile the original again
            network = network.kiln_model.original
        kiln_model = compiler.model_for(network, compiler.KilnPlan(compile=options), progress=plan_wrapper.progress_bar())
        if kiln_model.stats.fallback:
            return shared.eager(control_net, kiln_model.stats.fallback, "the ControlNet")
        compiled = control_net.copy()
        compiled.control_model = plan_wrapper.ShowCompiles(kiln_model, str(unique_id or ""))
        report = (f"Kiln will compile {type(network).__name__} on its first sampling step: "
                  f"{compiled.control_model.kiln_model.plan.describe()}.")
        log.info(report)
        return (compiled, report)


def unsupported_reason(control_net) -> str:
    """Why Kiln leaves this CONTROL_NET eager ("" if it compiles it)."""
    import comfy.controlnet

    kind = type(control_net).__name__
    if not isinstance(control_net, comfy.controlnet.ControlNet):
        return f"{kind} is not a ControlNet network Kiln compiles (T2I-Adapters run as they are)"
    if isinstance(control_net, comfy.controlnet.ControlLora):
        return "a Control LoRA builds its network from the diffusion model at each run: it runs as it is"
    if control_net.control_model is None:
        return f"this {kind} has no network loaded"
    return ""


NODE_CLASS_MAPPINGS = {"KilnCompileControlNet": KilnCompileControlNet}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnCompileControlNet": "Kiln › Compile ControlNet"}
