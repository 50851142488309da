"""nodes/plan_wrapper.py without ComfyUI: the clone Kiln's nodes take of a MODEL (tests/comfyui has the wrapper's runs
on ComfyUI's own classes)."""
from kiln.nodes.plan_wrapper import static_clone


class PatcherBeforeDynamicVram:  # ComfyUI 0.8: clone() takes nothing
    def clone(self):
        return "plain clone"


class PatcherWithDynamicVram:  # ComfyUI 0.33: clone(disable_dynamic=False, model_override=None, force_deepcopy=False)
    def clone(self, disable_dynamic=False, model_override=None, force_deepcopy=False):
        return f"clone, disable_dynamic={disable_dynamic}"


def test_a_clone_is_never_a_dynamic_vram_patcher_as_core_compile_takes_it():
    assert static_clone(PatcherWithDynamicVram()) == "clone, disable_dynamic=True"


def test_a_comfyui_without_dynamic_vram_gets_a_plain_clone():
    assert static_clone(PatcherBeforeDynamicVram()) == "plain clone"
