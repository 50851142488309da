"""Lowering block regions in the background (compiler/regional/background.py): the blocks run eagerly until
their region's code is ready, one region is lowered at a time, and nothing differs from a region
lowered in the foreground once it is."""
import logging
import os
import sys
import threading

import pytest
import torch

import kiln
from kiln.compiler import CompileOptions, OptionsError, parse_expert_options
from kiln.compiler.backend import lowering as lowering_module
from kiln.compiler.regional import region_choice
from kiln.compiler.regional.background import NICENESS, LoweringThread
from kiln.compiler.regional.region_choice import RegionTiming, fresh_copies
from kiln.compiler.regional.regional_compile import CompiledRegion
from testing_utils import Block, fail_lowering_of_width, rel_err, two_region_net



_net = two_region_net


def _compile(module, progress=None, mode="fast", **options):
    options.setdefault("measure_regions", False)
    return kiln.compile(module, options=CompileOptions(mode=mode, background=True, **options), progress=progress)


@pytest.fixture
def gate(monkeypatch):
    """Holds each lowering on the background thread until the test lets it go: `gate.open()`."""
    real, opened, threads = CompiledRegion._lower_in_background, threading.Event(), []

    def held(self, *args):
        threads.append(threading.current_thread())
        assert opened.wait(60)
        return real(self, *args)

    monkeypatch.setattr(CompiledRegion, "_lower_in_background", held)
    opened.threads = threads
    yield opened
    opened.set()


def _lowered(compiled) -> list[str]:
    """Wait for the region being lowered; the regions still waiting."""
    return kiln.wait_lowered(compiled, timeout=60)


def test_blocks_run_eagerly_until_their_region_is_lowered_one_region_at_a_time(gate):
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module)
    with torch.inference_mode():
        assert rel_err(compiled(x), module(x)) < 1e-6
        info = kiln.stats(compiled)
        # both regions handed in; the thread holds the first, the second is queued behind it
        assert info.compile_count == 0 and kiln.wait_lowered(compiled, timeout=0) == ["Block#1", "Block#2"]
        assert rel_err(compiled(x), module(x)) < 1e-6 and info.compile_count == 0
        gate.set()
        assert _lowered(compiled) == [] and [c.region for c in info.compiles] == ["Block#1", "Block#2"]
        assert rel_err(compiled(x), module(x)) < 1e-6
        for shape in ((2, 8, 3, 5), (3, 8, 4, 6)):  # a new batch and resolution compile nothing
            y = torch.randn(shape)
            assert rel_err(compiled(y), module(y)) < 1e-6
    assert len(gate.threads) == 2 and all(t is not threading.main_thread() for t in gate.threads)
    # captured on the thread under the caller's inference mode and thread count: no recompile on the model's
    assert info.compile_count == 2 and not info.recompiles and info.eager_calls == 0 and info.fallback is None


def test_the_inputs_held_for_waiting_regions_are_bounded_and_a_region_past_the_bound_hands_in_later(monkeypatch, gate):
    from kiln.compiler.regional import background

    module, x = _net(), torch.randn(2, 8, 3, 5)
    one_region = 2 * 15 * 16 * 4  # Block#1's input: batch 2, 15 tokens, 16 channels, fp32
    monkeypatch.setattr(background, "MAX_HELD_BYTES", one_region)
    compiled = _compile(module)
    with torch.no_grad():
        compiled(x)  # Block#1 held (its lowering waits at the gate); Block#2's inputs would pass the bound
        assert kiln.wait_lowered(compiled, timeout=0) == ["Block#1", "Block#2"]
        gate.set()
        assert _lowered(compiled) == ["Block#2"]  # Block#1 done; Block#2 never handed in
        assert rel_err(compiled(x), module(x)) < 1e-6  # now Block#2 hands in: alone, past the bound too
        assert _lowered(compiled) == [] and kiln.stats(compiled).compile_count == 2


def test_a_region_whose_inputs_wait_past_the_bound_asks_the_cache_and_the_rules_once(monkeypatch, gate, tmp_path):
    from kiln.compiler.regional import background

    asked = []
    real = CompiledRegion._stored_choice

    def stored_choice(self, block, args, kwargs):
        asked.append(self.region.name)
        return real(self, block, args, kwargs)

    monkeypatch.setattr(CompiledRegion, "_stored_choice", stored_choice)
    monkeypatch.setattr(background, "MAX_HELD_BYTES", 2 * 15 * 16 * 4)  # Block#1's input alone
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = kiln.compile(module, options=CompileOptions(mode="fast", background=True, measure_regions=False),
                            cache_dir=str(tmp_path))
    with torch.no_grad():
        for _ in range(3):  # Block#1 held at the gate; Block#2's inputs wait past the bound, call after call
            assert rel_err(compiled(x), module(x)) < 1e-6
    assert asked == ["Block#1", "Block#2"]
    gate.set()
    with torch.no_grad():
        _lowered(compiled)
        compiled(x)  # now Block#2 hands in, without asking again
        assert _lowered(compiled) == [] and kiln.stats(compiled).compile_count == 2
    assert asked == ["Block#1", "Block#2"]


def test_held_inputs_come_back_on_their_device_as_inference_tensors_or_not_and_in_their_containers():
    from kiln.compiler.regional.background import HeldInputs

    with torch.inference_mode():
        inference = torch.randn(2, 3)
    plain = torch.randn(4, 2).t()  # a transpose: its strides kept
    args, kwargs = (inference, (plain, 7)), {"options": {"scale": plain, "name": "x"}}
    held = HeldInputs(args, kwargs)
    assert held.nbytes == HeldInputs.bytes_of(args, kwargs) == 2 * plain.numel() * 4 + inference.numel() * 4
    (a, (b, seven)), kwargs = held.given()
    assert a.is_inference() and not b.is_inference() and seven == 7 and kwargs["options"]["name"] == "x"
    assert torch.equal(a, inference) and torch.equal(b, plain) and b.stride() == plain.stride()
    assert b.data_ptr() != plain.data_ptr() and kwargs["options"]["scale"].data_ptr() != plain.data_ptr()


def test_the_progress_callback_is_never_called_from_the_lowering_thread():
    """ComfyUI's callback reads and clears the user's cancel for the prompt: the thread must not take it."""
    seen = []
    compiled = _compile(_net(), progress=lambda what, done, total: seen.append(threading.current_thread()))
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(2, 8, 3, 5))
            _lowered(compiled)
    assert kiln.stats(compiled).compile_count == 2 and all(t is threading.main_thread() for t in seen)


def test_a_region_lowered_in_the_background_is_measured_by_its_next_call(monkeypatch):
    answers = [(0.5, 1.0), (2.0, 1.0)]  # Block#1 faster compiled, Block#2 slower
    measured_on = []

    def fake(compiled_call, eager_call, args, kwargs, device, rounds=region_choice.ROUNDS):
        measured_on.append(threading.current_thread())
        compiled_call(*fresh_copies(args, kwargs))
        eager_call(*fresh_copies(args, kwargs))
        return RegionTiming(*answers.pop(0))

    monkeypatch.setattr(region_choice, "time_both", fake)
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, measure_regions=True)
    with torch.no_grad():
        for _ in range(4):
            assert rel_err(compiled(x), module(x)) < 1e-6
            _lowered(compiled)
    info = kiln.stats(compiled)
    assert set(info.region_timings) == {"Block#1", "Block#2"} and measured_on == [threading.main_thread()] * 2
    assert list(info.regions_eager) == ["Block#2"] and "measured no faster compiled" in info.regions_eager["Block#2"]


def test_a_region_whose_lowering_fails_in_the_background_runs_eagerly_and_says_why(monkeypatch, caplog):
    fail_lowering_of_width(monkeypatch, 32)
    caplog.set_level(logging.INFO, "kiln")
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module)
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(compiled(x), module(x)) < 1e-6
            _lowered(compiled)
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert [c.region for c in info.compiles] == ["Block#1"] and info.fallback is None
    assert list(info.region_fallbacks) == ["Block#2"] and "lowering exploded" in info.region_fallbacks["Block#2"]
    assert "region Block#2 lowered in the background" in caplog.text and "runs eagerly: compile failed" in caplog.text


def test_the_block_s_own_error_on_the_thread_sends_the_region_to_eager_and_the_model_still_answers(monkeypatch):
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module)
    real = CompiledRegion._run_compiled

    def failing(self, block, args, kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise MemoryError("out of memory on the copies")
        return real(self, block, args, kwargs)

    monkeypatch.setattr(CompiledRegion, "_run_compiled", failing)
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(compiled(x), module(x)) < 1e-6
            _lowered(compiled)
    info = kiln.stats(compiled)
    assert "failed while lowered in the background (MemoryError: out of memory" in info.region_fallbacks["Block#1"]


def test_background_is_an_option_of_compiling_by_blocks_without_cuda_graphs():
    assert CompileOptions(background=True).as_dict()["background"] is True
    assert parse_expert_options("background: true") == {"background": True}
    with pytest.raises(OptionsError, match="compile_unit: whole"):
        CompileOptions(background=True, compile_unit="whole")
    with pytest.raises(OptionsError, match="background and cuda_graphs"):
        CompileOptions(background=True, cuda_graphs=True)
    with pytest.raises(OptionsError, match="background=1: use true or false"):
        CompileOptions(background=1)


def test_without_background_nothing_waits():
    compiled = kiln.compile(_net(), options=CompileOptions(mode="fast", measure_regions=False))
    with torch.no_grad():
        compiled(torch.randn(2, 8, 3, 5))
    assert kiln.wait_lowered(compiled) == [] and kiln.stats(compiled).compile_count == 2


def test_the_thread_lowers_under_the_settings_a_foreground_lowering_has_and_leaves_the_caller_s_as_they_were(
        monkeypatch):
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    from kiln.compiler.torch_compat import dynamo

    real, seen = lowering_module.lower_graph, []

    def lower(self, *args, **kwargs):
        seen.append((threading.current_thread() is threading.main_thread(), fx_config.use_duck_shape,
                     dynamo_config.fake_tensor_cache_enabled, dynamo.recompile_limit()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(lowering_module, "lower_graph", lower)
    before = (fx_config.use_duck_shape, dynamo_config.fake_tensor_cache_enabled, dynamo.recompile_limit())
    foreground = kiln.compile(_net(), options=CompileOptions(mode="balanced", measure_regions=False))
    with torch.no_grad():
        foreground(torch.randn(2, 8, 3, 5))
    in_foreground, seen[:] = list(seen), []
    compiled = _compile(_net(), mode="balanced")
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(2, 8, 3, 5))
            _lowered(compiled)
    assert [s[0] for s in in_foreground] == [True, True] and [s[0] for s in seen] == [False, False]
    assert [s[1:] for s in seen] == [s[1:] for s in in_foreground] and in_foreground[0][1:3] == (False, False)
    assert (fx_config.use_duck_shape, dynamo_config.fake_tensor_cache_enabled, dynamo.recompile_limit()) == before


def test_a_torch_that_keeps_its_settings_process_wide_lowers_in_the_foreground_and_says_so(monkeypatch, caplog):
    from kiln.compiler.torch_compat import dynamo

    monkeypatch.setattr(dynamo, "settings_per_thread", lambda: False)
    module, x = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module)
    with torch.no_grad():
        assert rel_err(compiled(x), module(x)) < 1e-6
    info = kiln.stats(compiled)
    assert info.compile_count == 2 and kiln.wait_lowered(compiled, timeout=0) == []
    assert "regions are lowered in the foreground" in caplog.text and any("process-wide" in w for w in info.warnings)


class PatchedBlock(Block):
    """Calls ComfyUI's attention patch, as ComfyUI's transformer blocks do, with its position."""

    def forward(self, x, transformer_options=None):
        for patch in transformer_options.get("patches", {}).get("attn1_patch", []):
            x = patch(x, transformer_options["block"])
        return super().forward(x)


class PatchedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(PatchedBlock(16) for _ in range(3))

    def forward(self, x, transformer_options):
        for index, block in enumerate(self.blocks):
            x = block(x, transformer_options={**transformer_options, "block": ("input", index)})
        return x


def test_a_region_whose_blocks_call_comfyui_patches_is_lowered_in_the_foreground_by_its_call(caplog, comfy_host):
    caplog.set_level(logging.INFO, "kiln")
    torch.manual_seed(0)
    module, x = PatchedNet().eval(), torch.randn(2, 4, 16)
    options = {"patches": {"attn1_patch": [lambda h, where: h * (1.0 + where[1])]}}
    compiled = _compile(module)
    with torch.no_grad():
        assert rel_err(compiled(x, options), module(x, options)) < 1e-6
    info = kiln.stats(compiled)
    assert info.compile_count >= 1 and [c.region for c in info.compiles][0] == "PatchedBlock#1"
    assert kiln.wait_lowered(compiled, timeout=0) == [] and "is lowered in the foreground, by this call" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_the_lowering_runs_at_a_lower_priority_than_the_model_s_thread():
    seen = {}

    def job():
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = LoweringThread("test")
    assert thread.submit("job", job, lambda: True) and thread.wait(60)
    assert seen["nice"] == max(NICENESS, os.getpriority(os.PRIO_PROCESS, 0))
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == os.getpriority(os.PRIO_PROCESS, 0)


def test_the_thread_runs_ready_jobs_in_order_and_a_job_that_is_not_ready_waits_for_wake():
    order, gate, thread = [], {"open": False}, LoweringThread("test")
    assert thread.submit("a", lambda: order.append("a"), lambda: True)
    assert thread.submit("b", lambda: order.append("b"), lambda: gate["open"])
    assert thread.submit("c", lambda: order.append("c"), lambda: True)
    assert thread.wait(60) and order == ["a", "c"] and thread.queued() == ["b"] and not thread.busy()
    gate["open"] = True
    thread.wake()
    assert thread.wait(60) and order == ["a", "c", "b"] and thread.queued() == []


def test_a_failing_job_is_logged_and_the_next_still_runs(caplog):
    order, thread = [], LoweringThread("test")

    def fail():
        raise RuntimeError("job exploded")

    thread.submit("bad", fail, lambda: True)
    thread.submit("good", lambda: order.append("good"), lambda: True)
    assert thread.wait(60) and order == ["good"] and "lowering bad in the background failed" in caplog.text


def test_a_thread_that_fails_outside_a_job_still_lets_its_waiters_go(monkeypatch, caplog):
    from kiln.compiler.regional import background

    def refused():
        raise RuntimeError("no thread priority here")

    monkeypatch.setattr(background, "lower_priority", refused)
    thread = LoweringThread("test")
    thread.submit("job", lambda: None, lambda: True)
    assert thread.wait(60) and not thread.busy() and thread.queued() == ["job"]
    assert "the background lowering stopped" in caplog.text and "no thread priority here" in caplog.text


def test_a_model_that_compiles_whole_under_background_says_the_first_call_waits():
    compiled = kiln.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                            options=CompileOptions(mode="fast", background=True))
    with torch.no_grad():
        compiled(torch.randn(2, 4))
    info = kiln.stats(compiled)
    assert info.compile_count == 1 and any("background: the model compiles whole" in w for w in info.warnings)


def test_after_the_exit_hook_the_queued_jobs_are_dropped_and_none_is_taken(caplog):
    ran, thread = [], LoweringThread("test")
    assert thread.submit("waits", lambda: ran.append("waits"), lambda: False, nbytes=10)
    thread.stop_at_exit()
    assert "Kiln: test: the process exits; 1 queued lowering(s) dropped: waits" in caplog.text
    assert thread.queued() == [] and thread._held == 0
    # a model still sampling on a daemon thread of its own (ComfyUI's prompt worker) hands nothing in
    assert not thread.can_hold(0) and not thread.submit("later", lambda: ran.append("later"), lambda: True)
    assert thread.wait(0) and ran == [] and thread.queued() == []


EXITING = """
import logging, sys, time
from pathlib import Path
from kiln.compiler.regional.background import LoweringThread
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
done = Path(sys.argv[1])
def lower(name, seconds):
    def job():
        time.sleep(seconds)
        (done / name).write_text("lowered")
    return job
thread = LoweringThread("Net")
thread.submit("Block#1", lower("Block#1", 1.0), lambda: True)
thread.submit("Wide#1", lower("Wide#1", 0.0), lambda: True)
while thread.lowering != "Block#1":
    time.sleep(0.01)
"""


def test_a_process_that_exits_while_a_region_lowers_waits_for_that_lowering_and_drops_the_queued_ones(tmp_path):
    """A daemon thread ended midway inside torch's C++ code at the interpreter's exit aborts the process
    ("terminate called without an active exception", seen with `kiln bench --prompts`)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "Block#1").read_text() == "lowered" and not (tmp_path / "Wide#1").exists()
    assert ("Kiln: Net: the process exits once the background lowering of Block#1 ends (1 queued lowering(s) "
            "dropped: Wide#1)") in done.stderr


MODEL_EXITING = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
import kiln
from testing_utils import two_region_net
model = kiln.compile(two_region_net(), options=kiln.CompileOptions(mode="balanced", background=True,
                                                                   measure_regions=False))
with torch.inference_mode():
    model(torch.randn(2, 8, 4, 4))
thread = model._regions.background.thread
while thread.lowering != "Block#1":  # exit while it lowers
    time.sleep(0.01)
"""


@pytest.mark.slow
def test_a_model_lowering_in_the_background_at_the_process_s_exit_does_not_abort_it(tmp_path):
    """In an empty Inductor cache, as on a machine's first compile: the lowering the exit waits for still
    builds kernels, which it could not once concurrent.futures had shut down before the wait."""
    import subprocess

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    done = subprocess.run([sys.executable, "-c", MODEL_EXITING, tests], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("the process exits once the background lowering of Block#1 ends (1 queued lowering(s) dropped: "
            "Block#2)") in done.stderr
    assert "failed" not in done.stderr  # the lowering waited for ended as it would have, not cut short


def test_a_region_lowered_in_the_background_at_a_pinned_shape_gets_its_static_variants():
    module, pinned = _net(), torch.randn(2, 8, 8, 8)  # 64x64 px
    compiled = _compile(module, mode="balanced", compile_unit="blocks", shapes={"pin": ["64x64"]})
    with torch.no_grad():
        compiled(pinned)
        assert _lowered(compiled) == []
        assert rel_err(compiled(pinned), module(pinned)) < 1e-5
    variants = kiln.stats(compiled).variants
    assert [(v.how, v.note) for v in variants] == [("compiled", ""), ("specialised", "pinned")] * 2
    assert [v.calls for v in variants if v.how == "specialised"] == [6, 2]  # the second call's six and two blocks


def test_the_thread_decides_static_variants_by_the_model_call_its_held_inputs_came_from():
    """The thread runs in the context of the call that started it; the inputs it lowers may come from a
    later call, at another shape: theirs decides."""
    from kiln.compiler.regional.background import CallerState, HeldInputs
    from kiln.compiler.shapes.shape_manager import CallShape

    module, other = _net(), torch.randn(2, 8, 3, 5)
    compiled = _compile(module, mode="balanced", compile_unit="blocks", shapes={"pin": ["64x64"]})
    compiled._prepare()
    region, tokens = compiled._regions.regions[0], torch.randn(2, 64, 16)  # Block#1's input at 64x64 px
    with torch.no_grad(), compiled._regions.routed(None, (other,), {}):  # the call under way: 3x5, not pinned
        region._lower_in_background(module.blocks[0], HeldInputs((tokens,), {}), CallerState(), CallShape(2, (8, 8), 2))
    assert [(v.how, v.note) for v in kiln.stats(compiled).variants] == [("compiled", ""), ("specialised", "pinned")]
