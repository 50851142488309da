"""ComfyUI's process-wide settings, made once before any test module here imports comfy: ComfyUI
reads them when its modules load (the attention implementation among them), so every test module
must see the same ones. They are what a CPU server started with `main.py --cpu
--use-pytorch-cross-attention` runs with. Without COMFYUI_PATH the test modules skip themselves."""
import os
import sys

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if COMFYUI_PATH and os.path.isdir(os.path.join(COMFYUI_PATH, "comfy")):
    sys.path.insert(0, COMFYUI_PATH)
    try:
        import comfy.cli_args
    except ImportError:  # a broken tree: the modules' importorskip says so
        pass
    else:
        comfy.cli_args.args.cpu = True  # what `main.py --cpu` sets, before model_management reads it
        comfy.cli_args.args.use_pytorch_cross_attention = True  # SDPA attention, as such a server


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _comfy_host(comfy_host):
    """In a ComfyUI process Kiln's nodes have registered ComfyUI's block conventions (nodes/block_inputs.py)."""
    yield


FAKE_CARD = 4 * 2**20       # the faked card's total memory (small_card)
FAKE_FREE = 2**20           # its free memory after the load


@pytest.fixture
def small_card(monkeypatch):
    """A small card in ComfyUI's own accounting, on a CPU (where load_models_gpu never loads partly: it sets
    VRAMState.DISABLED there): its planner hands a model's load only the dict's "fraction" of its size (LoadedModel.model_load's
    `lowvram_model_memory`, what load_models_gpu computes from the free memory; unset: its own plan), and it
    reports a card of FAKE_CARD bytes with FAKE_FREE free and no reserve (the dict's "card" and "free"). Every model is unloaded before and
    after, so each load is planned afresh."""
    import comfy.model_management as mm

    mm.unload_all_models()
    budget = {"card": FAKE_CARD, "free": FAKE_FREE}
    model_load = mm.LoadedModel.model_load

    def planned(self, lowvram_model_memory=0, force_patch_weights=False):
        if "fraction" in budget:   # as load_models_gpu plans: the budget less what is loaded already, 0 never
            lowvram_model_memory = int(self.model.model_size() * budget["fraction"]) - self.model_loaded_memory()
            lowvram_model_memory = lowvram_model_memory or 0.1
        return model_load(self, lowvram_model_memory, force_patch_weights=force_patch_weights)

    monkeypatch.setattr(mm.LoadedModel, "model_load", planned)
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False:
                        (FAKE_FREE, FAKE_FREE) if torch_free_too else FAKE_FREE)
    monkeypatch.setattr(mm, "extra_reserved_memory", lambda: 0)   # no --reserve-vram on the faked card
    monkeypatch.setattr(mm, "get_total_memory", lambda dev=None, torch_total_too=False:
                        (FAKE_CARD, FAKE_CARD) if torch_total_too else FAKE_CARD)
    yield budget
    mm.unload_all_models()
