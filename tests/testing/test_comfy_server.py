"""testing/comfy_server.py: a ComfyUI tree without its frontend package (the bundle's) is served headless."""
import stat

from kiln.testing.comfy_server import headless_front_end


def _python(tmp_path, has_frontend: bool):
    """A stand-in interpreter whose probe answers as one with (exit 1) or without (exit 0) the frontend package."""
    path = tmp_path / ("with" if has_frontend else "without")
    path.write_text(f"#!/bin/sh\nexit {1 if has_frontend else 0}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_tree_with_an_empty_web_folder_and_no_frontend_package_is_served_from_it(tmp_path):
    (tmp_path / "web").mkdir()
    assert headless_front_end(tmp_path, _python(tmp_path, has_frontend=False)) == ["--front-end-root",
                                                                                  str(tmp_path / "web")]


def test_the_frontend_package_or_no_web_folder_leaves_comfyuis_own_choice(tmp_path):
    assert headless_front_end(tmp_path, _python(tmp_path, has_frontend=False)) == []
    (tmp_path / "web").mkdir()
    assert headless_front_end(tmp_path, _python(tmp_path, has_frontend=True)) == []
