"""What Kiln's backend says about each graph: why it was compiled, and where TorchDynamo broke the model."""
import logging

import torch

import kiln
from testing_utils import rel_err


class Gated(torch.nn.Module):
    """A patch in the style of IPAdapter's: reads a tensor with `.item()` to decide what to do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, sigma):
        h = self.a(x)
        if sigma.item() > 0.5:  # TorchDynamo cannot trace .item(): the graph breaks here
            h = h * 2
        return self.b(h)


def test_a_graph_break_is_named_with_its_place_and_logged_once(caplog):
    module = Gated()
    compiled = kiln.compile(module, mode="fast")
    with caplog.at_level(logging.WARNING, logger="kiln"):
        for sigma in (0.7, 0.2, 0.9):
            x = torch.randn(3, 8)
            assert rel_err(compiled(x, torch.tensor(sigma)), module(x, torch.tensor(sigma))) < 1e-6
    info = kiln.stats(compiled)
    (where, graphs), = info.graph_breaks.items()
    assert "test_dynamo_backend.py" in where and "in forward: Unsupported Tensor.item()" in where and graphs == 1
    assert info.compiles[0].graph_breaks == [where] and info.compile_count >= 2
    assert f"graph break at {where}" in info.summary() and "ends at graph break" in info.compiles[0].line()
    assert caplog.text.count("TorchDynamo breaks the graph at") == 1


def test_a_model_without_graph_breaks_has_none():
    compiled = kiln.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU()), mode="fast")
    compiled(torch.randn(2, 4))
    assert kiln.stats(compiled).graph_breaks == {} and kiln.stats(compiled).compiles[0].graph_breaks == []


class Scaled(torch.nn.Module):
    def forward(self, x, options):
        return x * options["scale"] + (1 if options.get("shift") else 0)


def test_a_recompile_names_what_failed_on_the_newest_graph():
    """TorchDynamo records one guard failure per cached graph, the newest first: the newest one names
    what changed in this call; the oldest failed for an older change."""
    compiled = kiln.compile(Scaled(), mode="fast")
    x = torch.randn(2, 4)
    compiled(x, {"scale": 2.0})
    compiled(x, {"scale": 2.0, "shift": True})  # graph 1: another key
    compiled(x, {"scale": 2.0, "shift": False})  # graph 2: graph 1 fails on shift's value
    info = kiln.stats(compiled)
    assert info.compile_count == 3, info.summary()
    assert "shift" in info.recompiles[1].reason and "True" in info.recompiles[1].reason, info.recompiles[1].reason
