import pytest

from kiln.compiler import CompileOptions, OptionsError, build_options, parse_expert_options


def test_defaults_are_balanced():
    opts = CompileOptions()
    assert (opts.mode, opts.dynamic, opts.cuda_graphs) == ("balanced", None, None)
    assert opts.cuda_graphs_choice == "auto"


def test_cuda_graphs_auto_on_off():
    from kiln.choices import CUDA_GRAPHS, DEFAULT_CUDA_GRAPHS

    assert DEFAULT_CUDA_GRAPHS == CompileOptions().cuda_graphs_choice
    for name in CUDA_GRAPHS:
        assert CompileOptions(cuda_graphs=name).cuda_graphs_choice == name
    assert CompileOptions(cuda_graphs=True).cuda_graphs_choice == "on"  # the explicit forms keep working
    assert CompileOptions(cuda_graphs=False).cuda_graphs_choice == "off"
    assert build_options(advanced="cuda_graphs: auto").compile.cuda_graphs is None
    assert build_options(cuda_graphs=False).compile.cuda_graphs is False
    auto = CompileOptions()
    assert auto.whole_call_graphs("cuda") and auto.whole_call_graphs("cuda:1")
    assert not auto.whole_call_graphs("cpu")  # on the CPU auto means off, and says nothing
    assert not CompileOptions(cuda_graphs=True).whole_call_graphs("cuda")
    assert CompileOptions(background=True).background  # auto is no CUDA-graph option background refuses


def test_glue_regions_auto_on_off():
    from kiln.choices import DEFAULT_GLUE_REGIONS, GLUE_REGIONS

    assert CompileOptions().glue_regions == DEFAULT_GLUE_REGIONS == "auto"
    assert [CompileOptions(glue_regions=name).glue_regions for name in GLUE_REGIONS] == list(GLUE_REGIONS)
    assert build_options(advanced="glue_regions: on").compile.glue_regions == "on"  # YAML's bare on: True
    assert build_options(advanced="glue_regions: off").compile.glue_regions == "off"
    with pytest.raises(OptionsError, match="glue_regions=3: use one of auto, on, off"):
        CompileOptions(glue_regions=3)


@pytest.mark.parametrize("text", ['{"passes": {"fuse_geglu": "on"}}', "passes:\n  fuse_geglu: on\n"])
def test_expert_string_json_or_yaml(text):
    opts = build_options("fast", advanced=text).compile  # YAML's bare `on` is a boolean: read as the switch "on"
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
    settings = {"coordinate_descent_tuning": True, "triton.persistent_reductions": False}
    options = CompileOptions(inductor=settings)
    assert options.inductor == settings and options.as_dict()["inductor"] == settings


def test_empty_expert_string_is_nothing():
    assert parse_expert_options("  ") == {}


@pytest.mark.parametrize("advanced, key", [
    ("passes: 5", r"passes=5: use a mapping"),
    ("passes: {fuse_geglu: [1]}", r"passes\.fuse_geglu=\[1\]: use one of auto, on, off"),
    ("passes: {1: on}", r"passes: unknown pass 1;"),
    ("inductor: 5", r"inductor=5: use a mapping"),
    ("inductor: {coordinate_descent_tuning: [1, 2]}", r"inductor\.coordinate_descent_tuning=\[1, 2\]: use true or false"),
    ('dynamic: "yes"', r"dynamic='yes': use true, false or null"),
    ("dynamic: 1", r"dynamic=1: use true, false or null"),
    ("fullgraph: 1", r"fullgraph=1: use true or false"),
    ("cuda_graphs: [true]", r"cuda_graphs=\[True\]: use one of auto, on, off"),
    ("mode: [fast]", r"mode=\['fast'\] is not a Kiln mode"),
    ('{"mode": "' + "x" * 10_000 + '"}', r"mode='x+\.\.\.x+' is not a Kiln mode"),
])
def test_every_mistyped_option_is_an_options_error_naming_its_key(advanced, key):
    """Each of these raised TypeError (not iterable, unhashable) or was accepted; now the key, the value
    (shortened) and what is allowed."""
    with pytest.raises(OptionsError, match="^" + key) as caught:
        build_options("balanced", advanced=advanced).compile
    assert len(str(caught.value)) < 400


def test_empty_sections_are_empty():
    options = build_options("balanced", advanced="passes:\ninductor:\nshapes:\n").compile
    assert options.passes == {} and options.inductor == {} and options.shapes == CompileOptions().shapes


@pytest.mark.parametrize("cache, message", [
    ('{dir: "kiln\\0cache"}', "^cache"), ("{mode: [1]}", "^cache mode"), ("5", "^cache"), ("{max_gb: .inf}", "^cache max_gb"),
    ("{max_gb: 1" + ":59" * 800 + "}", "^cache")])  # YAML base 60: an int too large for a float
def test_bad_cache_settings_in_the_expert_string_are_options_errors(cache, message):
    from kiln.compiler import build_options

    with pytest.raises(OptionsError, match=message):
        build_options(advanced=f"cache: {cache}").cache
