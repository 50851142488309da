"""Pass identities are real cache-key inputs: they change with the pass, the shared helpers or
the kernel, and Kiln puts them into Inductor's FX graph cache key while it lowers."""
import contextlib
import os

import torch

import kiln
from kiln.compiler.torch_compat import inductor
from kiln.compiler.passes import PASSES, passes_uuid
from kiln.compiler.passes.base import hash_files


def test_hash_files_changes_with_any_file(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    before = hash_files([a, b])
    assert hash_files([a, b]) == before
    b.write_text("y = 3\n")
    assert hash_files([a, b]) != before


def test_each_pass_hashes_its_file_the_shared_helpers_and_its_kernel():
    for graph_pass in PASSES:
        files = graph_pass.source_files()
        assert all(os.path.isfile(f) for f in files), files
        names = [os.path.basename(f) for f in files]
        assert f"{graph_pass.name}.py" in names and "base.py" in names
        if graph_pass.kernel_op:
            assert f"{graph_pass.kernel_op.split('::')[1]}.py" in names and "_library.py" in names
        assert graph_pass.uuid() == hash_files(files)


def test_the_pipeline_id_changes_when_one_pass_changes(monkeypatch):
    before = passes_uuid()
    monkeypatch.setattr(type(PASSES[1]), "uuid", lambda self: "changed")
    assert passes_uuid() != before


def test_inductor_lowering_puts_the_pipeline_id_into_the_cache_key(monkeypatch):
    tags = []

    def recording_tag(tag):
        tags.append(tag)
        return contextlib.nullcontext()

    monkeypatch.setattr(inductor, "cache_key_tag", recording_tag)
    module = torch.nn.Linear(4, 4)
    compiled = kiln.compile(module, mode="balanced")
    x = torch.randn(3, 4)
    assert torch.allclose(compiled(x), module(x), atol=1e-6)
    assert tags == [f"kiln-{passes_uuid()}"]
