"""Option text from a workflow (Compile UNet's `advanced`, Quantize Model's `policy`) is read safely:
bounded size and depth, no YAML aliases, messages that name the key and never print a huge value."""
import json
import random
import time

import pytest
import yaml

from kiln.compiler import OptionsError, build_options, parse_expert_options, parse_policy
from kiln.compiler.options.inductor_settings import KILN_OWNED, TUNING
from kiln.compiler.options.option_text import MAX_DEPTH, MAX_TEXT_CHARS, parse_mapping_text, shorten
from kiln.compiler.passes import PASS_NAMES
from kiln.compiler.quantize import QuantizeError

# "billion laughs": 9 levels of 9 aliases each, 9**9 (387 million) strings once expanded, in about 300 characters.
# Before the shared parser, printing the value in the error (keep: "must be a list of name patterns, got ...") or
# str() of each pin expanded it until the server ran out of memory.
_LEVELS = ["&a [lol,lol,lol,lol,lol,lol,lol,lol,lol]"] + [
    f"&{name} [{','.join([f'*{prev}'] * 9)}]" for prev, name in zip("abcdefgh", "bcdefghi")]
ALIAS_BOMB = "[" + ", ".join(_LEVELS) + "]"


def test_parses_json_or_yaml_mappings_of_known_keys():
    assert parse_mapping_text('{"a": [1, 2]}', "thing", ("a", "b"), ValueError) == {"a": [1, 2]}
    assert parse_mapping_text("a: [1, 2]\nb: {c: on}", "thing", ("a", "b"), ValueError) == {"a": [1, 2], "b": {"c": True}}
    assert parse_mapping_text("  ", "thing", ("a",), ValueError) == {} == parse_mapping_text(None, "thing", ("a",), ValueError)
    with pytest.raises(OptionsError, match=r"^thing: unknown key\(s\) 'z'; allowed: a, b$"):
        parse_mapping_text("{a: 1, z: 2}", "thing", ("a", "b"), OptionsError)
    with pytest.raises(OptionsError, match=r"^thing must be a mapping with keys a; got list \[1, 2\]$"):
        parse_mapping_text("[1, 2]", "thing", ("a",), OptionsError)
    with pytest.raises(OptionsError, match="^thing must be text"):
        parse_mapping_text(5, "thing", ("a",), OptionsError)


@pytest.mark.parametrize("parse, text, error", [
    (parse_policy, f"keep: {ALIAS_BOMB}", QuantizeError),
    (lambda text: build_options(advanced=text).compile, f"shapes: {{pin: {ALIAS_BOMB}}}", OptionsError),
], ids=["policy-keep", "advanced-shapes-pin"])
def test_a_yaml_alias_bomb_is_refused_at_once_with_a_short_message(parse, text, error):
    assert len(text) < 400 and "*h" in text
    start = time.perf_counter()
    with pytest.raises(error, match="anchors or aliases") as caught:
        parse(text)
    assert time.perf_counter() - start < 5  # sanity bound only: it is refused before anything is expanded
    assert len(str(caught.value)) < 300


def test_a_single_anchor_is_refused_too():
    with pytest.raises(OptionsError, match="^advanced options text uses YAML anchors or aliases"):
        parse_expert_options("passes: &p {fuse_geglu: on}")


@pytest.mark.parametrize("text, key", [
    ("passes: {fuse_geglu: off}\nmode: max\npasses: {channels_last_convs: on}", "'passes'"),  # YAML, top level
    ('{"passes": {"fuse_geglu": "off"}, "mode": "max", "passes": {}}', "'passes'"),            # JSON, top level
    ("shapes:\n  pin: [1024x1024]\n  max_variants: 4\n  pin: []", "'pin'"),                 # YAML block, nested
    ('{"passes": {"fuse_geglu": "off", "fuse_geglu": "on"}}', "'fuse_geglu'"),                # JSON, nested
    ("{mode: max, passes: {fuse_geglu: on, fuse_geglu: off}}", "'fuse_geglu'"),               # YAML flow, nested
    ("inductor: {max_autotune: on, max_autotune: yes}", "'max_autotune'"),
    ("passes: {on: 1, yes: 2}", "True"),                                                       # both are YAML 1.1 true
    ("mode: fast\n<<: {mode: max}", "'mode'"),                                               # a merge gives it again
    ("<<: [{mode: max}, {mode: fast}]", "'mode'"),
])
def test_a_key_given_twice_is_refused_naming_it(text, key):
    """JSON and YAML keep the last of two equal keys and drop the first without a word: a setting lost."""
    with pytest.raises(OptionsError, match=rf"^advanced options text gives the key {key} twice in one mapping"):
        parse_expert_options(text)
    with pytest.raises(QuantizeError, match=rf"^layer policy text gives the key {key} twice in one mapping"):
        parse_policy(text)


def test_yaml_merge_keys_are_read_as_before_and_anchored_ones_still_refused():
    assert parse_expert_options("<<: {mode: max}\npasses: {fuse_geglu: off}") == {"mode": "max",
                                                                                  "passes": {"fuse_geglu": False}}
    with pytest.raises(OptionsError, match="^advanced options text uses YAML anchors or aliases"):
        parse_expert_options("passes: &p {fuse_geglu: on}\n<<: *p")


@pytest.mark.parametrize("text", [
    "[" * 5000 + "]" * 5000,                          # JSON
    '{"a": ' * 5000 + "1" + "}" * 5000,               # JSON
    "a: " + "[" * 5000 + "]" * 5000 + "\nb: 'x'",     # YAML flow (not JSON)
    "- " * 5000 + "x",                                 # YAML block
    "[" * 5000,                                        # neither, and deep
], ids=["json-list", "json-mapping", "yaml-flow", "yaml-block", "unclosed"])
def test_deep_nesting_is_refused_without_recursion(text):
    with pytest.raises(OptionsError, match=f"^advanced options text is nested deeper than {MAX_DEPTH} levels"):
        parse_expert_options(text)
    with pytest.raises(QuantizeError, match=f"^layer policy text is nested deeper than {MAX_DEPTH} levels"):
        parse_policy(text)


def test_nesting_up_to_the_limit_is_read():
    text = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_mapping_text(f'{{"a": {text[1:-1]}}}', "thing", ("a",), ValueError)["a"] == json.loads(text[1:-1])


def test_oversized_text_is_refused_naming_size_and_limit():
    text = "passes: {}\n" + "#" * MAX_TEXT_CHARS
    with pytest.raises(OptionsError, match=f"is {len(text):,} characters long; the limit is {MAX_TEXT_CHARS:,}"):
        parse_expert_options(text)


def test_messages_shorten_values():
    huge = "min_params: 1" + ":59" * 3000  # YAML 1.1 base 60: an int of ~17,700 bits, too long to print
    with pytest.raises(QuantizeError, match=r"^layer policy min_params must be >= 0.*got <a \d+-bit integer>$") as caught:
        parse_policy(huge.replace("min_params: 1", "min_params: -1"))
    assert len(str(caught.value)) < 200
    with pytest.raises(OptionsError, match=r"^advanced options: unknown key\(s\) <a \d+-bit integer>; allowed: mode"):
        parse_expert_options("? " + huge.removeprefix("min_params: ") + "\n: x")  # the same int as a key
    assert len(shorten("x" * 100_000)) < 80 and len(shorten([[["x"] * 1000] * 1000])) < 80
    with pytest.raises(OptionsError) as caught:
        build_options(advanced=json.dumps({"mode": "x" * 50_000})).compile
    assert len(str(caught.value)) < 200


@pytest.mark.parametrize("text", ["t: 2001-13-45", "t: 2001-01-01 10:00:00 +99:00", "x: !!python/object:os.system {}",
                                  "a: 1\n---\nb: 2", '{"a": 1' + "0" * 5000 + "}", "a: \x00"],
                         ids=["bad-date", "bad-timezone", "python-tag", "two-documents", "5000-digit-int", "nul"])
def test_what_yaml_cannot_build_is_an_error_of_the_project(text):
    with pytest.raises(QuantizeError, match="^layer policy text is neither JSON nor YAML"):
        parse_policy(text)


_ODD_VALUES = [None, True, 0, -1, 2 ** 70, 1.5, float("nan"), float("inf"), "", "x" * 5000, [], [1], [[1]], [None],
               {}, {"a": 1}, {"1": [1]}, [[True, 8]], [["a", "b"]], [{}], ["1024x1024", 5], "a\x00b", "\ud800"]
_ADVANCED_FIELDS = ["mode", "dynamic", "cuda_graphs", "fullgraph", "passes", "passes.fuse_geglu", "inductor",
                    "inductor.coordinate_descent_tuning", "inductor.max_autotune_gemm_backends", "shapes",
                    "shapes.specialize", "shapes.buckets", "shapes.pin", "shapes.max_variants", "shapes.max_cuda_graphs",
                    "cache", "cache.dir", "cache.mode", "cache.max_gb"]


def _nest(path: str, value):
    head, _, rest = path.partition(".")
    return {head: _nest(rest, value) if rest else value}


@pytest.mark.parametrize("value", _ODD_VALUES, ids=[type(v).__name__ + str(i) for i, v in enumerate(_ODD_VALUES)])
def test_every_field_takes_any_value_without_a_python_error(value):
    """Each field, set to each odd value, as JSON: the options (or the policy) or the project's error naming the key."""
    for path in _ADVANCED_FIELDS:
        text = json.dumps(_nest(path, value))
        for run in (lambda: build_options("balanced", advanced=text).compile, lambda: build_options(advanced=text).cache):
            try:
                run()
            except OptionsError as exc:
                assert str(exc).startswith(path.split(".")[0]), (path, str(exc))
                assert path.startswith("cache") or len(str(exc)) < 1000, (path, str(exc))  # cache's are CacheOptions' own
    for key in ("keep", "quantize", "min_params", "convs", "family"):
        try:
            parse_policy(json.dumps({key: value}))
        except QuantizeError as exc:
            assert str(exc).startswith(f"layer policy {key}") and len(str(exc)) < 1000, (key, str(exc))


# ---- fuzz: whatever a workflow holds, only the project's errors come out ----------------------------------------

_TOP_KEYS = ["mode", "dynamic", "cuda_graphs", "passes", "fullgraph", "inductor", "shapes", "compile_unit", "cache",  # advanced
             "keep", "quantize", "min_params", "convs", "family"]                                      # policy
_CHILD_KEYS = {"shapes": ["specialize", "buckets", "pin", "max_variants", "max_cuda_graphs"], "passes": list(PASS_NAMES),
               "inductor": [*TUNING, *KILN_OWNED, "cpp.cxx", "trace.debug_dir", "fx_graph_remote_cache", "max_autotun"],
               "cache": ["dir", "mode", "max_gb"]}
_SCALARS = [None, True, False, 0, 1, -1, 8, 64, 2 ** 70, 1.5, -0.0, float("inf"), float("nan"), 1e308, "", "on", "off",
            "auto", "fast", "balanced", "max", "none", "pinned", "buckets", "blocks", "whole", "sdxl", "sd15", "1024x1024",
            "832x1216:2", "1000x1001", "ATEN,TRITON", "DEFAULT", "use", "refresh", "kiln-cache", "*.attn2.*", "sd_unet",
            "a\x00b", "\ud800"]


# YAML that JSON cannot say: tags, timestamps, base-60 ints, merges, block scalars, complex keys, anchors
_YAML_VALUES = ["!!set {a, b}", "!!omap [a: 1]", "!!binary aGVsbG8=", "!!binary '%%'", "2001-13-45",
                "2001-12-14t21:59:43.10-05:00", "1" + ":59" * 800, "{<<: {mode: fast}, dynamic: true}", "[*a]",
                "&a 1", "!!python/name:os.system", ".inf", ".nan", "0x1F", "0o17", "1_000", "~", "|\n  text",
                ">\n  text", "'quoted'", '"\\x00"', "{? [a, b]: 1}", "{? " + "1" + ":59" * 800 + ": 1}", "!!str 5",
                "!!float x", "!!int 1e5", "[fuse_geglu, on]", "{fuse_geglu: on, coordinate_descent_tuning: yes}"]


def _yaml_case(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice(_TOP_KEYS)
        child = rng.choice(_CHILD_KEYS.get(key, [""]))
        value = rng.choice(_YAML_VALUES)
        lines.append(f"{key}: {{{child}: {value}}}" if child and rng.random() < 0.6 else f"{key}: {value}")
    return "\n".join(lines)


def _key(rng: random.Random, parent: str) -> str:
    if rng.random() < 0.1:
        return _text(rng, 8)
    return rng.choice(_CHILD_KEYS.get(parent, _TOP_KEYS))


def _value(rng: random.Random, parent: str, depth: int):
    roll = rng.random()
    if depth < 4 and roll < 0.3:
        return {(key := _key(rng, parent)): _value(rng, key, depth + 1) for _ in range(rng.randrange(4))}
    if depth < 4 and roll < 0.45:
        return [_value(rng, parent, depth + 1) for _ in range(rng.randrange(4))]
    return rng.choice(_SCALARS) if rng.random() < 0.85 else _text(rng, 12)


def _text(rng: random.Random, size: int) -> str:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(size))).decode("utf-8", "replace")


def _case(rng: random.Random) -> str:
    """Random bytes as text, YAML fragments, or a random document (keys mostly the real option names) as JSON or
    YAML, maybe damaged."""
    kind = rng.random()
    if kind < 0.1:
        return _text(rng, 60)
    if kind > 0.85:
        return _yaml_case(rng)
    top = rng.choice([_TOP_KEYS[:8], _TOP_KEYS[8:], _TOP_KEYS])
    document = {(key := rng.choice(top)): _value(rng, key, 1) for _ in range(rng.randrange(1, 4))}
    text = json.dumps(document) if rng.random() < 0.5 else yaml.safe_dump(document, allow_unicode=True)
    if kind < 0.25:  # damaged: a few characters changed
        cut = rng.randrange(len(text) + 1)
        text = text[:cut] + "".join(rng.choice("[]{}:,-&*!'\"\n #|>?") for _ in range(rng.randrange(4))) + text[cut + 1:]
    return text


def test_fuzzed_option_text_raises_only_the_projects_errors():
    rng = random.Random(0)
    escaped = []
    for _ in range(3000):
        text = _case(rng)
        for run, allowed in ((lambda: build_options(rng.choice(("fast", "balanced", "max")), advanced=text).compile, OptionsError),
                             (lambda: build_options(advanced=text).cache, OptionsError),
                             (lambda: parse_policy(text), QuantizeError)):
            try:
                run()
            except allowed:
                pass
            except Exception as exc:  # noqa: BLE001: collected and reported below
                escaped.append(f"{type(exc).__name__}: {str(exc)[:100]} <- {text[:120]!r}")
    assert not escaped, "\n".join(escaped[:10])
