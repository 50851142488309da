"""A workflow may change only Inductor's tuning settings (compiler/options/inductor_settings.py), never programs,
paths, remote caches, hooks or debug output."""
import pytest

import torch._inductor.config as inductor_config

from kiln.compiler import CompileOptions, OptionsError, build_options
from kiln.compiler.options.inductor_settings import KILN_OWNED, TUNING, allowed_names, setting_problem


@pytest.mark.parametrize("name, value", [
    ("cpp.cxx", ["/tmp/evil.sh"]),                 # Inductor runs it as the C++ compiler
    ("fx_graph_remote_cache", True),              # unpickles compiled graphs from a remote cache
    ("autotune_remote_cache", True),
    ("bundled_autotune_remote_cache", True),
    ("trace.enabled", True),                      # writes debug output ...
    ("trace.debug_dir", "/home/someone/.ssh"),    # ... anywhere
    ("cuda.cutlass_dir", "/tmp/evil"),
    ("aot_inductor.output_path", "/tmp/evil.so"),
    ("post_grad_custom_post_pass", None),         # a callable Inductor calls
    ("debug", True),
    ("freezing", True),                           # weights become constants: a LoRA patched later would be ignored
    ("cpp_wrapper", True),
    ("global_cache_dir", "/tmp/x"),
    ("worker_start_method", "fork"),
])
def test_settings_that_are_not_tuning_are_refused_naming_the_key(name, value):
    assert name in inductor_config.get_config_copy()  # a real Inductor setting: refused by the allowlist, not by a typo
    with pytest.raises(OptionsError, match=rf"^inductor\.{name.replace('.', '[.]')}: a workflow may change only "
                                           r"Inductor's tuning settings.*; allowed: max_autotune, ") as caught:
        build_options("balanced", advanced=f"inductor: {{{name}: {value!r}}}".replace("None", "null")).compile
    assert "coordinate_descent_tuning" in str(caught.value)


@pytest.mark.parametrize("name", sorted(KILN_OWNED))
def test_settings_kiln_owns_point_to_its_option(name):
    with pytest.raises(OptionsError, match=rf"^inductor\.{name.replace('.', '[.]')}: Kiln sets this itself; use "):
        CompileOptions(inductor={name: True})


def test_an_allowed_tuning_setting_still_works():
    options = build_options("max", advanced='{"inductor": {"coordinate_descent_tuning": true, '
                                           '"max_autotune_gemm_backends": "ATEN,TRITON", "max_fusion_size": 128}}').compile
    assert options.inductor == {"coordinate_descent_tuning": True, "max_autotune_gemm_backends": "ATEN,TRITON",
                                "max_fusion_size": 128}


@pytest.mark.parametrize("name, value, allowed", [
    ("coordinate_descent_tuning", "yes", "true or false"),
    ("coordinate_descent_tuning", 1, "true or false"),
    ("coordinate_descent_search_radius", True, "a whole number from 1 to 8"),
    ("coordinate_descent_search_radius", 10 ** 9, "a whole number from 1 to 8"),
    ("max_autotune_gemm_backends", "ATEN,CUTLASS", "a comma-separated list of ATEN, TRITON, CPP"),
    ("max_autotune_gemm_backends", "aten", "a comma-separated list of ATEN, TRITON, CPP"),
    ("max_autotune_gemm_search_space", "/tmp/x", "DEFAULT"),
])
def test_a_wrongly_typed_value_is_refused(name, value, allowed):
    with pytest.raises(OptionsError, match=rf"^inductor\.{name}=.*: use {allowed}"):
        CompileOptions(inductor={name: value})


def test_the_exhaustive_gemm_search_space_is_refused_like_cutlass():
    """EXHAUSTIVE makes Triton profile ~1,900 matmul configs per shape instead of ~20: a workflow could make
    every compile take hours, which is why CUTLASS and CK are refused too."""
    with pytest.raises(OptionsError, match=r"^inductor\.max_autotune_gemm_search_space='EXHAUSTIVE': use DEFAULT "
                                           r"\(EXHAUSTIVE is refused: it makes Triton profile about 1,900 kernels"):
        build_options("max", advanced="inductor: {max_autotune_gemm_search_space: EXHAUSTIVE}").compile
    assert CompileOptions(inductor={"max_autotune_gemm_search_space": "DEFAULT"}).inductor == {
        "max_autotune_gemm_search_space": "DEFAULT"}


def test_unknown_names_are_still_called_unknown():
    with pytest.raises(OptionsError, match=r"^inductor: 'max_autotun' is not an Inductor config setting"):
        CompileOptions(inductor={"max_autotun": True})
    with pytest.raises(OptionsError, match=r"^inductor: 5 is not an Inductor config setting"):
        CompileOptions(inductor={5: True})


def test_every_allowed_setting_accepts_torchs_own_default():
    """The allowlist's value rules agree with this torch: its defaults pass, so a value of the default's type can."""
    defaults = inductor_config.get_config_copy()
    assert allowed_names() and set(allowed_names()) <= set(TUNING)
    for name in allowed_names():
        assert setting_problem(name, defaults[name]) is None, name


def test_an_allowed_name_this_torch_lacks_is_left_out_of_the_list(monkeypatch):
    from kiln.compiler.torch_compat import inductor

    monkeypatch.setattr(inductor, "is_inductor_option", lambda name: name != "max_fusion_size")
    assert "max_fusion_size" not in allowed_names()
    assert "max_fusion_size" not in setting_problem("cpp.cxx", "g++").split("allowed: ")[1].split(", ")
    assert "not an Inductor config setting" in setting_problem("max_fusion_size", 64)
