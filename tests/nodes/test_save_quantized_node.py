"""Kiln › Save Quantized Model's filename and overwrite, as a workflow (untrusted) sets them: the file stays in
diffusion_models, and overwrite replaces only a file this node wrote, never a model of the user's (no ComfyUI
needed: folder_paths and the quantized model's writer are stood in for)."""
import os
import sys
import types

import pytest
import safetensors.torch
import torch

from kiln.nodes import quant_patcher
from kiln.nodes.quantize_model import MAX_FILENAME_BYTES, SAVED_BY, SAVED_BY_KEY, KilnSaveQuantizedModel


@pytest.fixture
def models(tmp_path, monkeypatch):
    """models/diffusion_models, and a writer that saves {"w": `model`} with the node's metadata, as the real one does."""
    folder = tmp_path / "models" / "diffusion_models"
    folder.mkdir(parents=True)
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_folder_paths = lambda kind: [str(tmp_path / "models" / "unet"), str(folder)]
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)

    def write(model, path, metadata):
        safetensors.torch.save_file({"w": model}, path, metadata=metadata)
        return "Kiln"
    monkeypatch.setattr(quant_patcher, "save", write)
    return folder


def _stored(path):
    return safetensors.torch.load_file(str(path))["w"].item()


def test_it_saves_in_diffusion_models_and_a_folder_below_it_marking_the_file_as_its_own(models):
    shown = KilnSaveQuantizedModel().save(torch.tensor([1.0]), "kiln/quantized")["ui"]["text"]
    path = models / "kiln" / "quantized.safetensors"
    assert shown[0] == str(path) and _stored(path) == 1.0
    with safetensors.safe_open(str(path), "pt") as file:
        assert file.metadata() == {SAVED_BY_KEY: SAVED_BY}


def test_overwrite_replaces_a_file_this_node_saved(models):
    KilnSaveQuantizedModel().save(torch.tensor([1.0]), "kiln/quantized")
    with pytest.raises(FileExistsError, match=r"^filename 'kiln/quantized': .* exists; choose another filename or set "
                                              r"overwrite$"):
        KilnSaveQuantizedModel().save(torch.tensor([2.0]), "kiln/quantized")
    KilnSaveQuantizedModel().save(torch.tensor([2.0]), "kiln/quantized.safetensors", overwrite=True)
    assert _stored(models / "kiln" / "quantized.safetensors") == 2.0


def _users_model(path):
    safetensors.torch.save_file({"w": torch.tensor([7.0])}, str(path), metadata={"modelspec.title": "FLUX.1 dev"})


def _other_safetensors(path):  # a Kiln-looking key with another value
    safetensors.torch.save_file({"w": torch.tensor([7.0])}, str(path), metadata={SAVED_BY_KEY: "someone else"})


def _not_safetensors(path):
    path.write_bytes(b"\x00" * 64)


def _huge_header(path):  # claims a 2**60-byte header: refused by safetensors without reading it
    path.write_bytes((2 ** 60).to_bytes(8, "little") + b"{}")


def _link_to_a_kiln_file(path):  # a link is the user's even if it points at a file Kiln saved
    KilnSaveQuantizedModel().save(torch.tensor([7.0]), "elsewhere")
    path.symlink_to(path.parent / "elsewhere.safetensors")


def _folder(path):
    path.mkdir()


@pytest.mark.parametrize("make", [_users_model, _other_safetensors, _not_safetensors, _huge_header,
                                  _link_to_a_kiln_file, _folder])
@pytest.mark.parametrize("overwrite", [True, False])
def test_a_file_this_node_did_not_save_is_never_replaced(models, make, overwrite):
    """Before: overwrite=True replaced any file, e.g. the user's flux1-dev.safetensors."""
    path = models / "flux1-dev.safetensors"
    make(path)
    before = sorted(os.listdir(models))
    with pytest.raises(FileExistsError, match=rf"^filename 'flux1-dev': {path} exists and is not a file {SAVED_BY} "
                                              rf"wrote .*no {SAVED_BY_KEY}: .*Kiln never replaces it, even with "
                                              rf"overwrite; choose another filename$"):
        KilnSaveQuantizedModel().save(torch.tensor([1.0]), "flux1-dev", overwrite=overwrite)
    assert sorted(os.listdir(models)) == before
    if make in (_users_model, _link_to_a_kiln_file):
        assert _stored(path) == 7.0


@pytest.mark.parametrize("filename, message", [
    ("", r"filename is empty"),
    ("   ", r"filename is empty"),
    ("a\x00b", r"filename 'a\\x00b' holds the character '\\x00'; use printable characters only"),
    ("a\nb", r"filename 'a\\nb' holds the character '\\n'"),
    ("x" * (MAX_FILENAME_BYTES + 1), rf"filename is {MAX_FILENAME_BYTES + 1} bytes long \(UTF-8\); the limit is "
                                     rf"{MAX_FILENAME_BYTES}"),
    ("é" * (MAX_FILENAME_BYTES // 2 + 1), rf"filename is {MAX_FILENAME_BYTES + 2} bytes long"),  # 2 bytes each
    ("x" * 300, r"filename is 300 bytes long"),  # before: OSError File name too long
    ("kiln/", r"filename 'kiln/' has an empty name before, between or after a '/'"),
    ("kiln//x", r"filename 'kiln//x' has an empty name"),
    ("kiln/ ", r"filename 'kiln/ ' has an empty name"),
    (".safetensors", r"filename '.safetensors': '.safetensors' starts with '.', which makes a hidden file"),
    ("kiln/.safetensors", r"filename 'kiln/.safetensors': '.safetensors' starts with '.'"),
    (".cache/x", r"filename '.cache/x': '.cache' starts with '.'"),
    ("kiln/../x", r"filename 'kiln/../x': '..' starts with '.'"),
    ("../x", r"filename '../x' leaves the diffusion_models folder"),
    ("/tmp/x", r"filename '/tmp/x' leaves the diffusion_models folder"),
    (5, r"filename must be text, got int"),
])
def test_a_bad_filename_is_refused_naming_it_and_nothing_is_written(models, filename, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        KilnSaveQuantizedModel().save(torch.tensor([1.0]), filename)
    assert os.listdir(models) == [] and not os.path.exists(models.parent.parent / "x.safetensors")


def test_the_longest_filename_allowed_saves(models):
    name = "x" * (MAX_FILENAME_BYTES - len(".safetensors")) + ".safetensors"
    KilnSaveQuantizedModel().save(torch.tensor([1.0]), name)
    assert _stored(models / name) == 1.0


def test_a_file_where_its_folder_should_be_is_an_error_naming_filename(models):
    KilnSaveQuantizedModel().save(torch.tensor([1.0]), "kiln")
    with pytest.raises(ValueError, match=r"^filename 'kiln.safetensors/x': cannot make the folder .*kiln.safetensors"):
        KilnSaveQuantizedModel().save(torch.tensor([1.0]), "kiln.safetensors/x")
