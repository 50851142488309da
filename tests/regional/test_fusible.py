"""Whether a captured graph gives Inductor anything to fuse (compiler/regional/fusible.py), on TorchDynamo's own graphs."""
import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.regional.fusible import LIBRARY_OPS, IdleRecord, computing_ops, idle_record


def captured(fn, *args) -> torch.fx.GraphModule:
    """The FX graph TorchDynamo hands a backend for `fn(*args)`."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=record, fullgraph=True)(*args)
    return graphs[0]


def test_a_convolution_alone_has_nothing_to_fuse():
    conv = torch.nn.Conv2d(4, 4, 3, stride=2, padding=1)
    gm = captured(lambda x: conv(x), torch.randn(1, 4, 8, 8))
    assert idle_record(gm).reason() == "nothing for Inductor to fuse (conv2d)"


def test_a_resize_and_a_convolution_have_nothing_to_fuse():
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    gm = captured(lambda x: conv(F.interpolate(x, scale_factor=2.0, mode="nearest")), torch.randn(1, 4, 8, 8))
    assert idle_record(gm).reason() == "nothing for Inductor to fuse (interpolate, conv2d)"


def test_views_are_not_work():
    linear = torch.nn.Linear(8, 8)
    gm = captured(lambda x: linear(x.flatten(1)).view(2, 2, 4).transpose(1, 2).contiguous(), torch.randn(2, 2, 4))
    assert computing_ops(gm) == ["linear"] and idle_record(gm) is not None


def test_two_elementwise_ops_or_a_norm_and_an_activation_are_worth_lowering():
    norm, conv = torch.nn.GroupNorm(2, 4), torch.nn.Conv2d(4, 4, 3, padding=1)
    gm = captured(lambda x: conv(F.silu(norm(x))), torch.randn(1, 4, 8, 8))
    assert idle_record(gm) is None
    gm = captured(lambda x, y: (x * 2) + y, torch.randn(4), torch.randn(4))
    assert idle_record(gm) is None


def test_arithmetic_on_dynamic_sizes_is_not_work():
    """ComfyUI's and diffusers' Upsample pass the output size: with dynamic shapes it is computed
    from SymInts in the graph, which generates no kernel."""
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def upsample(x):
        return conv(F.interpolate(x, size=(x.shape[2] * 2, x.shape[3] * 2), mode="nearest"))

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(upsample, backend=record, dynamic=True, fullgraph=True)(torch.randn(2, 4, 6, 8))
    assert any(op_name == "mul" for op_name in (n.target.__name__ for n in graphs[0].graph.nodes
                                                  if n.op == "call_function" and hasattr(n.target, "__name__")))
    assert idle_record(graphs[0]).reason() == "nothing for Inductor to fuse (interpolate, conv2d)"


def test_the_verdict_is_a_record_that_reads_back_as_it_was_written():
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    gm = captured(lambda x: conv(F.interpolate(x, scale_factor=2.0, mode="nearest")), torch.randn(1, 4, 8, 8))
    record = idle_record(gm)
    assert record == IdleRecord(("interpolate", "conv2d"))
    assert record.reason() == "nothing for Inductor to fuse (interpolate, conv2d)"
    assert IdleRecord.from_bytes(record.to_bytes(), "here") == record
    # the most a graph with nothing to fuse can name: every library op and one op Inductor could fuse
    every_library_op_and_one_more = IdleRecord((*sorted(LIBRARY_OPS), "silu"))
    assert IdleRecord.from_bytes(every_library_op_and_one_more.to_bytes(), "here") == every_library_op_and_one_more


@pytest.mark.parametrize("data, field", [
    (b"x" * 2000, "2000 bytes"),
    (b"not json", "not JSON"),
    (b"[" * 500 + b"]" * 500, "exactly the field ops"),
    (b'{"ops": ["conv2d"], "more": 1}', "exactly the field ops"),
    (b'{"ops": "conv2d"}', "ops is not a list"),
    (b'{"ops": [' + b'"conv2d",' * 16 + b'"mm"]}', "ops is not a list"),
    (b'{"ops": ["conv2d; rm -rf /"]}', "not an op name"),
    (b'{"ops": [3]}', "not an op name"),
    (b'{"ops": ["conv2d", "conv2d"]}', "twice"),
    (b'{"ops": ["silu", "add"]}', "ops Inductor could fuse"),
], ids=lambda value: value.decode()[:24] if isinstance(value, bytes) else None)
def test_a_stored_verdict_is_read_as_untrusted_data(data, field):
    with pytest.raises(ValueError, match="the stored verdict") as caught:
        IdleRecord.from_bytes(data, "the stored verdict")
    assert field in str(caught.value)
