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


def test_a_region_that_failed_to_compile_is_shown_on_the_node(monkeypatch):
    import sys
    import types

    from kiln.compiler import KilnStats
    from kiln.nodes import plan_wrapper

    shown = []
    server = types.SimpleNamespace(send_progress_text=lambda text, node_id: shown.append((node_id, text)))
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=server)))
    stats = KilnStats(options={})
    mark = plan_wrapper.compile_mark(stats)
    stats.region_fallbacks["ResBlock#1"] = "compile failed: AssertionError: Expect size to be a plain tuple of ints"
    plan_wrapper.show_compiles_since("7", stats, mark)
    assert shown == [("7", "Kiln: region ResBlock#1 runs eagerly from now on: compile failed: AssertionError: "
                           "Expect size to be a plain tuple of ints")]
    plan_wrapper.show_compiles_since("7", stats, plan_wrapper.compile_mark(stats))  # nothing new: nothing shown
    assert len(shown) == 1
