"""Kiln › Cache Graph's directory, as a workflow names it: confined to ComfyUI's user directory and the
server's KILN_CACHE_DIR (no ComfyUI needed: folder_paths is stood in for)."""
import sys
import types

import pytest

from kiln.compiler import CacheOptionsError, cache_problem
from kiln.nodes.shared import default_cache_dir, workflow_cache


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_user_directory = lambda: str(tmp_path / "user")
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    monkeypatch.delenv("KILN_CACHE_DIR", raising=False)
    return tmp_path / "user"


def test_empty_is_kiln_cache_in_the_user_directory_and_a_relative_name_a_folder_there(user_dir):
    assert workflow_cache("", "use", 20.0).named == str(user_dir / "kiln-cache") == default_cache_dir()
    options = workflow_cache(" fast ", "use", 20.0)
    assert options.named == str(user_dir / "fast") and cache_problem(options) == ""
    assert (user_dir / "fast" / "entries").is_dir()


@pytest.mark.parametrize("named", ["~", "/tmp/kiln-elsewhere", "../outside", "~/work"])
def test_a_directory_outside_is_refused_and_nothing_is_made_there(user_dir, named, tmp_path):
    options = workflow_cache(named, "use", 20.0)
    problem = cache_problem(options)
    assert "outside the directories a workflow may use" in problem and str(user_dir) in problem
    assert "KILN_CACHE_DIR" in problem
    assert not (tmp_path / "outside").exists()


def test_the_servers_kiln_cache_dir_is_the_default_and_allowed(user_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "fast-disk"))
    assert default_cache_dir() == str(tmp_path / "fast-disk") == workflow_cache("", "use", 20.0).named
    assert cache_problem(workflow_cache(str(tmp_path / "fast-disk" / "sdxl"), "use", 20.0)) == ""
    assert "outside" in cache_problem(workflow_cache(str(tmp_path / "other"), "use", 20.0))


def test_a_directory_that_is_not_text_names_the_setting(user_dir):
    with pytest.raises(CacheOptionsError, match=r"cache dir=\[1\]: give a directory path"):
        workflow_cache([1], "use", 20.0)
