"""How a Kiln plan rides on a ComfyUI MODEL, and how it runs: one APPLY_MODEL wrapper.

Each Kiln node clones the ModelPatcher and adds its part to the plan kept in the clone's model
options under PLAN_KEY; the clone gets one Kiln wrapper, which swaps the plan's KilnModel in
for `diffusion_model` only while the model runs (as core's TorchCompileModel does) and puts the
original back afterwards. The original module keeps owning the weights, so LoRA, merges and
low-VRAM offload patch it as usual and the compiled code reads those live weights. Everything
that decides what runs (the plan's steps, eager fallback, cancel, shape hints) is the compiler's.
"""
from __future__ import annotations

import inspect
import logging
import re

from ..events import COMPILE_EVENT, WORK_PROGRESS, WorkProgress

log = logging.getLogger("kiln")

PLAN_KEY = "kiln_plan"              # model_options[PLAN_KEY]: the KilnPlan
WRAPPER_KEY = "kiln.compile"        # APPLY_MODEL wrapper key
CORE_COMPILE_KEY = "torch.compile"  # ComfyUI core's TorchCompileModel wrapper
MIN_COMFYUI = "0.3.7"               # the first ComfyUI with comfy.patcher_extension's model wrappers
# The oldest and the newest ComfyUI that Kiln's tests pass on; the first is pyproject.toml's requires-comfyui.
TESTED_COMFYUI = ("0.8.0", "0.33.0")


def missing_extension_points() -> str:
    """Why this ComfyUI cannot carry a Kiln plan ("" if it can)."""
    try:
        from comfy.patcher_extension import WrappersMP

        WrappersMP.APPLY_MODEL  # noqa: B018
    except (ImportError, AttributeError) as exc:
        return (f"this ComfyUI (version {comfyui_version()}) has no model wrappers ({exc}); Kiln needs ComfyUI "
                f"{MIN_COMFYUI} or newer")
    return ""


def comfyui_version() -> str:
    """The running ComfyUI's version ("unknown" where it does not say)."""
    try:
        from comfyui_version import __version__ as version
    except ImportError:
        return "unknown"
    return str(version)


def comfyui_range_note(version: str) -> tuple[int, str]:
    """(log level, line) saying where ComfyUI `version` stands against TESTED_COMFYUI: a warning when it is older
    than the oldest tested, an info line otherwise (newer than the newest tested is said, not refused)."""
    oldest, newest = TESTED_COMFYUI
    tested = f"Kiln is tested on ComfyUI {oldest} to {newest}"
    number = _release(version)
    if number is None:
        return logging.INFO, f"Kiln on a ComfyUI of unknown version {version!r}; {tested}"
    if number < _release(oldest):
        return logging.WARNING, (f"Kiln on ComfyUI {version}, older than {oldest}: {tested}; if a Kiln node fails "
                                 f"here, update ComfyUI first")
    if number > _release(newest):
        return logging.INFO, f"Kiln on ComfyUI {version}, newer than Kiln's tests have seen; {tested}"
    return logging.INFO, f"Kiln on ComfyUI {version}; {tested}"


def _release(version: str):
    """(major, minor, patch) of a version such as "0.33.0" or "0.8.0rc1"; None if it is not one."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if match is None else tuple(int(part or 0) for part in match.groups())


def declare(model_patcher, show_cache_on: str = "", show_compile_on: str = "", **part):
    """A clone of `model_patcher` whose plan has `part` added, with Kiln's wrapper installed.
    `show_cache_on` / `show_compile_on`: the ids of the nodes that show each cache hit or miss (Cache
    Graph's) and each compile and shape variant (Compile UNet's) as they happen; a node declared later
    keeps the ones set earlier. Returns (clone, plan, note); the note says if core's
    TorchCompileModel wrapper was replaced."""
    from comfy.patcher_extension import WrappersMP

    from ..compiler import KilnPlan

    patched = static_clone(model_patcher)
    before = patched.model_options.get(PLAN_KEY) or KilnPlan()
    plan = before.with_parts(**part)
    patched.model_options[PLAN_KEY] = plan
    earlier = patched.get_wrappers(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    show_cache_on = show_cache_on or (earlier[0].show_cache_on if earlier else "")
    show_compile_on = show_compile_on or (earlier[0].show_compile_on if earlier else "")
    return patched, plan, _install(patched, KilnApplyModel(plan, show_cache_on, show_compile_on))


def static_clone(model_patcher):
    """A clone of `model_patcher` that is not one of ComfyUI's dynamic-VRAM patchers (ComfyUI 0.33+ on a CUDA GPU
    streams weights through comfy-aimdo's allocator, which compiled code must not trace through): what core's
    TorchCompileModel takes too (`clone(disable_dynamic=True)`; elsewhere, and on older ComfyUIs, a plain clone)."""
    if inspect.signature(model_patcher.clone).parameters.get("disable_dynamic") is None:
        return model_patcher.clone()
    return model_patcher.clone(disable_dynamic=True)


class KilnApplyModel:
    """The APPLY_MODEL wrapper: runs the diffusion model as the plan's KilnModel."""

    def __init__(self, plan, show_cache_on: str = "", show_compile_on: str = ""):
        self.plan = plan
        self.show_cache_on = show_cache_on      # node id that shows cache hits and misses in ComfyUI's UI
        self.show_compile_on = show_compile_on  # node id that shows compiles and shape variants
        self.said_core_skipped = False          # CORE_SKIPPED is said once per wrapper

    def __call__(self, executor, *args, **kwargs):
        import comfy.utils

        from ..compiler import model_for

        executor, skipped_core = without_core_compile(executor, args, kwargs)
        if skipped_core and not self.said_core_skipped:
            self.said_core_skipped = True
            log.warning("Kiln: %s", CORE_SKIPPED)
            show_text(self.show_compile_on, f"Kiln: {CORE_SKIPPED}")
        base_model = executor.class_obj
        original = comfy.utils.get_attr(base_model, "diffusion_model")
        kiln_model = model_for(original, self.plan, progress=progress_bar())
        self._use_memory(base_model, kiln_model)
        comfy.utils.set_attr(base_model, "diffusion_model", kiln_model)
        stats = kiln_model.stats
        cache, compiles = len(stats.cache), compile_mark(stats)
        try:
            return executor(*args, **kwargs)
        finally:
            comfy.utils.set_attr(base_model, "diffusion_model", original)
            if self.show_cache_on and len(stats.cache) > cache:
                show_text(self.show_cache_on, "\n".join(e.line() for e in stats.cache[cache:]))
            show_compiles_since(self.show_compile_on, stats, compiles)

    def _use_memory(self, base_model, kiln_model) -> None:
        """Tell the Kiln model how ComfyUI loaded it for this call (nodes/partial_load.py): under a partial load
        the blocks ComfyUI streams run eagerly; a new reason is shown on the Compile UNet node."""
        from . import partial_load

        said = kiln_model.stats.memory
        verdict = partial_load.verdict_for(base_model, kiln_model)
        kiln_model.use_memory(verdict)
        if verdict.why and (said is None or said.why != verdict.why):
            show_text(self.show_compile_on, f"Kiln: {verdict.why}")


CORE_REPLACED = "replaced ComfyUI's TorchCompileModel wrapper (two compilers cannot both own the model)"
CORE_SKIPPED = ("ComfyUI's TorchCompileModel comes after Kiln in this model's chain; Kiln compiles the model and "
                "skips core's compile wrapper (two compilers cannot both own the model)")


def without_core_compile(executor, args, kwargs):
    """(executor, skipped): `executor` without ComfyUI core's TorchCompileModel wrapper among the APPLY_MODEL
    wrappers still to run (a core compile node placed after Kiln's swaps its own compiled module in for Kiln's), and
    whether it had one. The wrappers still to run are the executor's after its index; core's are the ones under
    core's key in the call's transformer_options."""
    from comfy.patcher_extension import WrapperExecutor, WrappersMP, get_wrappers_with_key

    options = args[5] if len(args) > 5 else kwargs.get("transformer_options", {})
    core = get_wrappers_with_key(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY, options or {})
    still_to_run = executor.wrappers[executor.idx + 1:]
    kept = [wrapper for wrapper in still_to_run if not any(wrapper is c for c in core)]
    if len(kept) == len(still_to_run):
        return executor, False
    this_one = executor.wrappers[executor.idx]  # calling the new executor runs what follows it: kept
    return WrapperExecutor.new_class_executor(executor.original, executor.class_obj, [this_one, *kept]), True


class ShowCompiles:
    """A KilnModel to call in place of another model of a ComfyUI object (a VAE's decode, a
    ControlNet's control_model): calls it, shows what each call compiled on the Kiln node `node_id`,
    and reads every other attribute (dtype, ...) from it."""

    def __init__(self, kiln_model, node_id: str = ""):
        self.kiln_model = kiln_model
        self.node_id = node_id

    def __call__(self, *args, **kwargs):
        mark = compile_mark(self.kiln_model.stats)
        try:
            return self.kiln_model(*args, **kwargs)
        finally:
            show_compiles_since(self.node_id, self.kiln_model.stats, mark)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("kiln_model", "node_id"):  # copy/pickle probe before __init__
            raise AttributeError(name)
        return getattr(self.kiln_model, name)


def compile_mark(stats) -> tuple[int, int, int]:
    """Where a model's compiles, shape variants and block regions run eagerly stand, to show what a call added."""
    return len(stats.compiles), len(stats.variants), len(stats.region_fallbacks)


def show_compiles_since(node_id: str, stats, mark: tuple[int, int, int]) -> None:
    """Show the compiles, new shape variants and regions that failed to compile since `mark` on the node `node_id`
    (none: nothing), and send each compile's record (events.py) to the client that queued the prompt."""
    compiles, variants, failed_regions = mark
    events = [graph.event() for graph in stats.compiles[compiles:]]
    lines = [event.line() for event in events]
    if lines and compiles == 0 and stats.regions:
        lines.insert(0, f"Kiln compiles by blocks: {stats.units_line()}")
    lines += [f"Kiln variant: {v.line()}" for v in stats.variants[variants:] if v.how != "reused"]
    lines += [f"Kiln: region {name} runs eagerly from now on: {reason}"
              for name, reason in list(stats.region_fallbacks.items())[failed_regions:]]
    if node_id and lines:
        show_text(node_id, "\n".join(lines))
        send_events(node_id, events)


def _install(model_patcher, wrapper) -> str:
    """Add Kiln's wrapper to a clone's APPLY_MODEL wrappers, replacing core's or an earlier Kiln one."""
    from comfy.patcher_extension import WrappersMP

    note = ""
    if model_patcher.get_wrappers(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY):
        model_patcher.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY)
        note = CORE_REPLACED
    model_patcher.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, wrapper)
    return note


def show_text(node_id: str, text: str) -> None:
    """Show `text` on a node in ComfyUI's UI (its progress text, as core's Get Image Size does).
    Headless (no server running), the log already has it."""
    server = _prompt_server()
    if server is not None:
        server.send_progress_text(text, node_id)


def send_events(node_id: str, events: list) -> None:
    """Send each CompileEvent to the client that queued the running prompt, as a COMPILE_EVENT
    websocket message (what `kiln queue` reads; ComfyUI's page passes it by)."""
    for event in events:
        _send(COMPILE_EVENT, event, node_id)


def _prompt_server():
    """ComfyUI's running PromptServer, or None (headless, or no ComfyUI server in this process)."""
    try:
        from server import PromptServer
    except ImportError:
        return None
    return getattr(PromptServer, "instance", None)


def progress_bar(work: str = "compile"):
    """A progress callback for Kiln's `work` (compile, quantize) that drives ComfyUI's progress bar and the log, and
    sends what it does now to the client that queued the prompt (`kiln queue` shows it in its progress line). ComfyUI's
    cancel raises from ProgressBar.update (its interrupt check): the compile stops there."""
    bar = {}

    def progress(what: str, done: int, total: int) -> None:
        import comfy.utils

        if done == 1 or "bar" not in bar:
            bar["bar"] = comfy.utils.ProgressBar(total)
        if done == 1 or done == total or done % max(1, total // 10) == 0:
            log.info("Kiln %s: %s (%d/%d)", work, what, done, total)
        send_progress(WorkProgress(work, what, done, total))
        bar["bar"].update_absolute(done, total)

    return progress


def send_progress(progress: WorkProgress) -> None:
    """Send `progress` as a WORK_PROGRESS websocket message for the node that runs now (the sampler,
    during a compile: ComfyUI's own progress bar is that node's too); headless, nothing."""
    _send(WORK_PROGRESS, progress, None)


def _send(kind: str, record, node_id) -> None:
    """Send an events.py record as a websocket message of type `kind` to the client that queued the
    running prompt, for `node_id` (None: the node that runs now). Headless, nothing."""
    server = _prompt_server()
    if server is None:
        return
    if node_id is None:
        node_id = str(getattr(server, "last_node_id", "") or "")
    server.send_sync(kind, record.message(str(getattr(server, "last_prompt_id", "") or ""), node_id),
                     getattr(server, "client_id", None))
