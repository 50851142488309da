import pytest

from kiln.compiler import CompileOptions, OptionsError, build_options, parse_expert_options


def test_defaults_are_balanced():
    opts = CompileOptions()
    assert (opts.mode, opts.dynamic, opts.cuda_graphs) == ("balanced", None, False)


@pytest.mark.parametrize("text", ['{"passes": {"fuse_geglu": "on"}}', "passes:\n  fuse_geglu: on\n"])
def test_expert_string_json_or_yaml(text):
    opts = build_options("fast", advanced=text)  # YAML's bare `on` is a boolean: read as the switch "on"
    assert opts.passes == {"fuse_geglu": "on"} and opts.mode == "fast"


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "turbo"}, "mode='turbo' is not a Kiln mode"),
    ({"passes": {"fuse_everything": "on"}}, "unknown pass 'fuse_everything'"),
    ({"passes": {"fuse_geglu": "yes"}}, "passes.fuse_geglu='yes'"),
    ({"mode": "fast", "inductor": {"max_autotune": True}}, "no effect in mode 'fast'"),
    ({"cuda_graphs": "true"}, "cuda_graphs='true'"),
    ({"inductor": {"max_autotun": True}}, "'max_autotun' is not an Inductor config setting"),
])
def test_invalid_options_name_the_problem(kwargs, message):
    with pytest.raises(OptionsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CompileOptions(**kwargs)


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "must be a mapping"),
    ("{mode: fast, colour: red}", "unknown key\\(s\\) 'colour'"),
    ("{unbalanced: [", "neither JSON nor YAML"),
])
def test_invalid_expert_strings(text, message):
    with pytest.raises(OptionsError, match=message):
        parse_expert_options(text)


def test_inductor_settings_are_accepted_by_name():
    assert CompileOptions(inductor={"coordinate_descent_tuning": True, "triton.cudagraphs": False}).inductor


def test_empty_expert_string_is_nothing():
    assert parse_expert_options("  ") == {}
