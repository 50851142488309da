"""What an entry's key holds: a change to any field misses, and the miss names it."""
import os

import torch

from kiln.compiler.cache import entry_fields, entry_key, explain_miss, graph_hash
from kiln.compiler.cache import key as key_module
from kiln.compiler.torch_compat.fx_graphs import is_weight
from kiln.compiler.options.shape_policy import ShapePolicy


class Tiny(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x).relu()


def captured(module, x) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend)(x)
    return graphs[0]


def fields(graph="g", inputs=(torch.zeros(2, 8),), options=None, policy=None, device="cpu"):
    return entry_fields(graph, list(inputs), options or {"mode": "balanced"}, policy or ShapePolicy().as_dict(), device,
                        "Tiny graph 0")


def test_weight_values_are_not_in_the_graph_hash_but_weight_shapes_are():
    x = torch.randn(2, 8)
    first = graph_hash(captured(Tiny(), x), is_weight)
    torch.manual_seed(123)
    assert graph_hash(captured(Tiny(), x), is_weight) == first  # another weight set (LoRA, fine-tune) hits
    assert graph_hash(captured(Tiny(16), torch.randn(2, 16)), is_weight) != first


def test_the_label_is_shown_not_keyed():
    a, b = fields(), fields()
    b["label"] = "Other graph 3"
    assert entry_key(a) == entry_key(b)


def test_each_field_change_misses_and_the_miss_names_it(monkeypatch):
    stored = fields()
    cases = {
        "options": fields(options={"mode": "max"}),
        "dtypes": fields(inputs=(torch.zeros(2, 8, dtype=torch.float16),)),
        "inputs": fields(inputs=(torch.zeros(3, 8),)),
        "shape_policy": fields(policy=ShapePolicy(specialize="buckets").as_dict()),
    }
    for name, wanted in cases.items():
        assert entry_key(wanted) != entry_key(stored), name
        assert f"{name}" in explain_miss(wanted, [stored]), name
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    newer_torch = fields()
    assert entry_key(newer_torch) != entry_key(stored)
    assert "torch: " in explain_miss(newer_torch, [stored]) and "-> 2.99.0" in explain_miss(newer_torch, [stored])


def test_a_change_to_kilns_compiler_or_kernel_source_misses(monkeypatch):
    stored = fields()
    monkeypatch.setattr(key_module, "source_hash", lambda: "0000000000000000")
    changed = fields()
    assert entry_key(changed) != entry_key(stored)
    assert "-> " + key_module.kiln_version() + " source 0000000000000000" in explain_miss(changed, [stored])


def test_source_hash_covers_the_kernels(tmp_path, monkeypatch):
    """A change to a kernel's source misses: hashed over a copy of Kiln's sources, one kernel file changed."""
    import shutil

    import kiln

    root = tmp_path / "kiln"
    for folder in ("compiler", "kernels"):
        shutil.copytree(os.path.join(os.path.dirname(kiln.__file__), folder), root / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(key_module, "__file__", str(root / "compiler" / "cache" / "key.py"))
    key_module.source_hash.cache_clear()
    try:
        before = key_module.source_hash()
        with open(root / "kernels" / "__init__.py", "a") as f:
            f.write("\n# changed\n")
        key_module.source_hash.cache_clear()
        assert key_module.source_hash() != before
    finally:
        key_module.source_hash.cache_clear()


def test_a_miss_without_an_entry_of_the_graph_says_so():
    assert "no entry for this graph yet" in explain_miss(fields(graph="new"), [fields(graph="old")])


def test_the_closest_entry_is_named():
    wanted = fields(options={"mode": "max"})
    far = fields(options={"mode": "fast"}, inputs=(torch.zeros(5, 8),))
    near = fields()
    text = explain_miss(wanted, [far, near])
    assert "options.mode: fast -> max" not in text and "options.mode: balanced -> max" in text and "inputs" not in text
