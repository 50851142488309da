"""A recording key tells apart every call a replay would get wrong, and nothing else."""
import pytest
import torch

from kiln.compiler.graphs.recording_key import (MAX_DEPTH, CallModes, TensorSpec, Unkeyable, recording_key,
                                                weight_addresses)
from kiln.compiler.host_inputs import HostInputs


class OptionsHost(HostInputs):
    """A host whose options are dicts marked 'host': only 'patches' and 'half' are read by the call."""

    def call_fingerprint(self, value):
        if isinstance(value, dict) and value.get("host"):
            return (tuple(sorted(value.get("patches", {}))), tuple(value.get("half", ())))
        return None


def key(module, *args, host=None, **kwargs):
    return recording_key(module, args, kwargs, host or HostInputs())


def test_same_call_same_key_and_shape_changes_it():
    net = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert key(net, x) == key(net, torch.randn(2, 4))  # values are copied in, not keyed
    assert key(net, x) != key(net, torch.randn(3, 4))
    assert key(net, x) != key(net, x.double())
    assert key(net, x) != key(net, torch.randn(4, 2).t())  # same shape, other strides


def test_python_values_are_keyed_by_place():
    net = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert key(net, x, scale=1.0) != key(net, x, scale=2.0)
    assert key(net, x, flag=True) != key(net, x, flag=False)
    assert key(net, x, scale=1.0).values == (("kwargs['scale']", 1.0),)


def test_nested_tensors_are_keyed_with_their_place():
    net = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    control = {"input": [torch.randn(2, 8), torch.randn(2, 16)]}
    k = key(net, x, control=control)
    assert TensorSpec.of("kwargs['control']['input'][1]", control["input"][1]) in k.tensors
    other = {"input": [torch.randn(2, 8), torch.randn(2, 32)]}
    assert k != key(net, x, control=other)
    assert k != key(net, x, control={"input": [torch.randn(2, 8)]})  # one residual fewer


def test_host_options_keyed_by_the_hosts_fingerprint_and_their_tensors():
    net = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    host = OptionsHost()
    opts = {"host": True, "patches": {}, "half": [1, 0], "sigmas": torch.ones(2), "notes": object()}
    k = key(net, x, host=host, options=opts)
    assert ("kwargs['options']", ((), (1, 0))) in k.host
    assert any(spec.place == "kwargs['options']['sigmas']" for spec in k.tensors)
    assert k == key(net, x, host=host, options={**opts, "notes": object()})  # not read by the call: not keyed
    assert k != key(net, x, host=host, options={**opts, "half": [0, 1]})
    assert k != key(net, x, host=host, options={**opts, "patches": {"attn1_patch": [print]}})
    assert k != key(net, x, host=host, options={**opts, "sigmas": torch.ones(3)})


def test_unkeyable_arguments_are_named():
    net = torch.nn.Linear(4, 4)
    with pytest.raises(Unkeyable, match=r"kwargs\['opts'\]\['x'\] is a object"):
        key(net, torch.randn(2, 4), opts={"x": object()})
    deep = torch.randn(1)
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(Unkeyable, match="MAX_DEPTH"):
        key(net, deep)


def test_weights_addresses_and_shape_without_them():
    net = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    before = key(net, x)
    assert before.weights == weight_addresses(net) == (net.weight.data_ptr(), net.bias.data_ptr())
    net.weight.data.mul_(2)  # in place (ComfyUI's weight_inplace_update): same addresses, same key
    assert key(net, x) == before
    net.weight = torch.nn.Parameter(torch.randn(4, 4))  # a LoRA patch installs a new tensor
    after = key(net, x)
    assert after != before and after.shape == before.shape


def test_modes_are_keyed():
    net = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    plain = key(net, x)
    with torch.inference_mode():
        assert key(net, x).modes != plain.modes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key(net, x).modes != plain.modes
    with torch.enable_grad():
        assert key(net, x).modes == CallModes.now() != plain.modes
