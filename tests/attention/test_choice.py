"""The attention choice (compiler/attention/choice.py): the fastest backend that passes the fidelity check
against float32 math. Backends and their timings are injected; the inputs are real (on the CPU)."""
import pytest
import torch

from kiln.compiler.attention import choice as attention_choice
from kiln.compiler.attention.backends import BACKENDS, BY_NAME, AttentionBackend
from kiln.compiler.attention.choice import FIDELITY_TOLERANCE, AttentionKey, choose, relative_l2
from kiln.compiler.regional.gpu_time import GPU_TIME, SampleTime
from kiln.compiler.torch_compat.sdpa_backends import run_sdpa

CPU = torch.device("cpu")
KEY = AttentionKey(batch=2, heads=5, q_tokens=9, kv_tokens=7, head_dim=8, v_dim=8, dtype=torch.float32)


class Ran:
    """Which backend ran last: the injected backends write their names here, the clock reads them."""

    def __init__(self, times_ms: dict):
        self.times_ms, self.names, self.basis = times_ms, [], GPU_TIME

    def backend(self, name: str, run, in_graph: bool = True, module: str = "") -> AttentionBackend:
        def call(q, k, v, scale):
            self.names.append(name)
            return run(q, k, v, scale)
        return AttentionBackend(name, frozenset({"cpu"}), in_graph, call, module)

    def sample(self, run):  # the clock: a sample's time is its calls' injected times
        self.names.clear()
        run()
        return SampleTime(sum(self.times_ms[n] for n in self.names), 0.0)


def exact(q, k, v, scale):
    return run_sdpa("math", q, k, v, scale)


def wrong(q, k, v, scale):  # fast and wrong: the values' mean, not attention
    return v.mean(dim=2, keepdim=True).expand(*q.shape[:3], v.shape[-1]).clone()


def test_the_fastest_backend_within_the_tolerance_is_chosen_and_a_wrong_one_left_out():
    ran = Ran({"slow": 2.0, "fast": 1.0, "planted": 0.1})
    backends = [ran.backend("slow", exact), ran.backend("fast", exact), ran.backend("planted", wrong)]
    chosen = choose(KEY, CPU, None, backends, clock=ran)
    assert chosen.backend == "fast" and chosen.basis == GPU_TIME
    assert chosen.times_ms == {"fast": pytest.approx(1.0), "slow": pytest.approx(2.0)}
    assert "planted" not in chosen.times_ms and chosen.errors["planted"] > FIDELITY_TOLERANCE[torch.float32]
    assert chosen.left_out["planted"].startswith("relative L2 error ")
    assert chosen.left_out["planted"].endswith("against float32 math, over the 1e-05 allowed for float32")
    assert chosen.line().startswith("attention 2x5 heads, 9 x 7 tokens, d8, float32: fast chosen by GPU time "
                                    "(fast 1.000 ms, slow 2.000 ms); left out: planted: relative L2 error")


def test_the_choice_follows_the_timings():
    ran = Ran({"a": 3.0, "b": 1.5})
    assert choose(KEY, CPU, 0.3, [ran.backend("a", exact), ran.backend("b", exact)], clock=ran).backend == "b"
    ran.times_ms = {"a": 0.5, "b": 1.5}
    assert choose(KEY, CPU, 0.3, [ran.backend("a", exact), ran.backend("b", exact)], clock=ran).backend == "a"


def test_a_backend_that_cannot_run_the_shape_or_is_missing_or_outside_the_graph_is_left_out_with_why():
    ran = Ran({"ok": 1.0, "other": 2.0, "python": 3.0})

    def raises(q, k, v, scale):
        raise RuntimeError("No available kernel. Aborting execution.\nmore")

    backends = [ran.backend("ok", exact), ran.backend("other", exact), ran.backend("broken", raises),
                ran.backend("absent", exact, module="no_such_attention_package_xyz"),
                ran.backend("python", exact, in_graph=False)]
    chosen = choose(KEY, CPU, None, backends, clock=ran)
    assert chosen.backend == "ok"
    assert chosen.left_out == {
        "broken": "cannot run it (RuntimeError: No available kernel. Aborting execution.)",
        "absent": "no_such_attention_package_xyz is not installed",
        "python": "a Python call Inductor cannot lower (chosen in mode fast only)"}
    assert "python" in choose(KEY, CPU, None, backends, clock=ran, in_graph_only=False).times_ms


def test_a_lone_candidate_is_chosen_untimed_and_none_at_all_is_an_error():
    ran = Ran({})
    chosen = choose(KEY, CPU, None, [ran.backend("only", exact), ran.backend("planted", wrong)], clock=ran)
    assert chosen.backend == "only" and not chosen.times_ms
    assert "only the only candidate left" in chosen.line()
    with pytest.raises(RuntimeError, match="no attention backend ran 2x5 heads.*planted: relative L2 error"):
        choose(KEY, CPU, None, [ran.backend("planted", wrong)], clock=ran)


def test_on_a_cpu_the_shipped_candidates_leave_math_alone():
    chosen = choose(KEY, CPU, None)
    assert chosen.backend == "math" and not chosen.times_ms
    assert set(chosen.left_out) == {b.name for b in BACKENDS} - {"math"}
    assert all(why == "does not run on cpu" for why in chosen.left_out.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_math_in_a_half_dtype_passes_its_own_tolerance(dtype):
    key = AttentionKey(1, 4, 33, 17, 16, 16, dtype)
    q, k, v = attention_choice.random_inputs(key, CPU)
    out = BY_NAME["math"].run(q, k, v, None)
    reference = BY_NAME["math"].run(q.float(), k.float(), v.float(), None)
    assert relative_l2(out, reference) <= FIDELITY_TOLERANCE[dtype]
