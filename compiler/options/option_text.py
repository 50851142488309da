"""Option text from a workflow (JSON or YAML), read safely: one parser for every text widget.

A workflow is untrusted (anyone's, loaded with one drag), and Compile UNet's `advanced` and
Quantize Model's `policy` are free text in it. So the text is bounded before it is read: at most
MAX_TEXT_CHARS characters, nested at most MAX_DEPTH levels (checked before any recursive reader
runs: no RecursionError), no YAML anchors or aliases (a few hundred characters of them expand to
gigabytes, "billion laughs"), no key given twice in one mapping (JSON and YAML would keep the
last and drop the rest without a word; a YAML merge key's `<<` keys count too), and a mapping of
known keys at the top. Values in messages are shortened (`shorten`), never printed whole.
"""
from __future__ import annotations

import functools
import json
import re
import reprlib
from collections.abc import Hashable
from typing import Any, Iterable, Optional

MAX_TEXT_CHARS = 64 * 1024
MAX_DEPTH = 32  # Kiln's deepest option nests 4 levels ({shapes: {buckets: [[w, h]]}}); far below a stack overflow
_MAX_KEYS_SHOWN = 5
_MAX_SHOWN = 80  # characters of a value shown in a message
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)  # a string (skipped) or a bracket


class _Short(reprlib.Repr):
    """reprlib, but a huge int (YAML's base-60 `1:2:3:...` builds them) is described, not converted
    to digits (Python refuses to print ints over 4300 digits)."""

    def repr_int(self, x, level):
        if x.bit_length() > 256:
            return f"<a {x.bit_length()}-bit integer>"
        return super().repr_int(x, level)


_SHORT = _Short()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = 6
_SHORT.maxdict = 4
_SHORT.maxlevel = 2


def shorten(value: Any) -> str:
    """repr(value) cut to at most _MAX_SHOWN characters: what a message shows of a workflow's value."""
    text = _SHORT.repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + "..."


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"compile.mode": "fast", "compile.passes.fuse_geglu": "on", ...}: a nested mapping's leaves by
    their dotted names, to say which setting differs; an empty mapping adds nothing."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def parse_mapping_text(text: Any, what: str, allowed: Iterable[str], error_type: type[Exception]) -> dict:
    """The mapping a JSON or YAML text holds ("" or None: {}), its keys among `allowed`.
    Anything else raises `error_type` with a message that starts with `what` ("advanced options")."""
    if text is None:
        return {}
    if not isinstance(text, str):
        raise error_type(f"{what} must be text (JSON or YAML), got {type(text).__name__} {shorten(text)}")
    text = text.strip()
    if not text:
        return {}
    if len(text) > MAX_TEXT_CHARS:
        raise error_type(f"{what} text is {len(text):,} characters long; the limit is {MAX_TEXT_CHARS:,}")
    data = _load(text, what, error_type)
    allowed = tuple(allowed)
    if not isinstance(data, dict):
        raise error_type(f"{what} must be a mapping with keys {', '.join(allowed)}; got {type(data).__name__} "
                         f"{shorten(data)}")
    check_keys(data, allowed, what, error_type)
    return data


def check_keys(mapping: dict, allowed: Iterable[str], what: str, error_type: type[Exception]) -> None:
    """Raise `error_type` naming the keys of `mapping` that are not in `allowed`, and the allowed ones."""
    allowed = tuple(allowed)
    unknown = sorted((key for key in mapping if key not in allowed), key=shorten)  # repr: a huge int key raises
    if unknown:
        shown = ", ".join(shorten(key) for key in unknown[:_MAX_KEYS_SHOWN])
        more = f" and {len(unknown) - _MAX_KEYS_SHOWN} more" if len(unknown) > _MAX_KEYS_SHOWN else ""
        raise error_type(f"{what}: unknown key(s) {shown}{more}; allowed: {', '.join(allowed)}")


class _Refused(Exception):
    """Why Kiln will not read the text, found while it is read (a key given twice); not a ValueError, so
    the JSON reader's refusal does not fall through to YAML."""


def _twice(key: Any, where: str = "") -> _Refused:
    return _Refused(f"gives the key {shorten(key)} twice in one mapping{where}; only one value would be kept, "
                    f"so give each key once")


def _json_mapping(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object as a dict, refusing a key given twice."""
    mapping = {}
    for key, value in pairs:
        if key in mapping:
            raise _twice(key)
        mapping[key] = value
    return mapping


def _load(text: str, what: str, error_type: type[Exception]) -> Any:
    """JSON if the text is JSON (and shallow enough to read), else YAML."""
    if _json_depth(text) <= MAX_DEPTH:
        try:
            return json.loads(text, object_pairs_hook=_json_mapping)
        except ValueError:  # not JSON (or an int too long to convert): try YAML, which says what is wrong
            pass
        except _Refused as exc:
            raise error_type(f"{what} text {exc}") from None
    return _load_yaml(text, what, error_type)


def _json_depth(text: str) -> int:
    """How deeply brackets nest outside double-quoted strings: exactly json.loads' recursion depth."""
    depth = deepest = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def _load_yaml(text: str, what: str, error_type: type[Exception]) -> Any:
    import yaml

    try:
        refusal = _yaml_refusal(text)  # PyYAML's parser is a state machine: no recursion
        data = None if refusal else yaml.load(text, Loader=_yaml_loader())  # its composer recurses: <= MAX_DEPTH
    except _Refused as exc:
        refusal = str(exc)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:  # ValueError: e.g. the timestamp 2001-13-45
        problem = " ".join(str(exc).split())
        raise error_type(f"{what} text is neither JSON nor YAML ({problem[:300]})") from None
    if refusal:
        raise error_type(f"{what} text {refusal}")
    return data


@functools.cache
def _yaml_loader() -> type:
    """PyYAML's SafeLoader, refusing a key given twice in one mapping. Keys are compared as built, so
    `on` and `yes` (both True in YAML 1.1) are the same key, and so is a key a merge (`<<`) gives."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)  # merge keys into node.value, as SafeLoader does
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)  # built once: SafeLoader keeps it for below
                if isinstance(key, Hashable):  # an unhashable key: SafeLoader's own error, below
                    if key in seen:
                        raise _twice(key, f" (line {key_node.start_mark.line + 1})")
                    seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


def _yaml_refusal(text: str) -> Optional[str]:
    """Why Kiln will not compose this YAML (anchors or aliases, or too deep), from its event stream; or None."""
    import yaml

    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            return ("uses YAML anchors or aliases (&name, *name), which Kiln does not read (a few of them can "
                    "expand to gigabytes); write each value out")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                return f"is nested deeper than {MAX_DEPTH} levels; Kiln's options nest 4 at most"
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return None
