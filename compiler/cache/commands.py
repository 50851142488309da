"""`kiln cache list|info|clear|export|import`: the cache directory from the command line (no ComfyUI)."""
from __future__ import annotations

import argparse
import datetime
import json

from .describe import describe_cache
from .key import differences, environment_fields
from .options import CacheOptions, CacheOptionsError
from .store import CacheEntryError, CacheStore
from .trust import CacheError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="", help="the cache directory (default: KILN_CACHE_DIR, else ~/.cache/kiln; "
                        "ComfyUI's node uses ComfyUI/user/kiln-cache)")
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every entry: key, model graph, size, compile time saved per load, last used")
    info = actions.add_parser("info", help="the directory, or one entry's key fields (and what differs from this machine)")
    info.add_argument("key", nargs="?", help="an entry key (a unique prefix is enough)")
    clear = actions.add_parser("clear", help="remove entries (all, or those named)")
    clear.add_argument("keys", nargs="*")
    export = actions.add_parser("export", help="write entries (all, or those named) to a file for another machine")
    export.add_argument("file")
    export.add_argument("keys", nargs="*")
    imported = actions.add_parser("import", help="sign and store the entries of an exported file: you trust its code")
    imported.add_argument("file")


def _when(timestamp: float) -> str:
    """A time as people read it; "-" for none, "?" for one the system cannot show (a file's mtime set far off)."""
    try:
        return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M") if timestamp else "-"
    except (OverflowError, ValueError, OSError):
        return "?"


def _resolve(store: CacheStore, prefixes: list[str]) -> list[str]:
    keys = store.keys()
    out = []
    for prefix in prefixes:
        found = [key for key in keys if key.startswith(prefix)]
        if len(found) != 1:
            raise CacheEntryError(f"{prefix!r} names {len(found)} entries in {store.entries} (give more of the key)")
        out.append(found[0])
    return out


def main(args: argparse.Namespace) -> int:
    try:
        options = CacheOptions(dir=args.dir)
        store = options.open()
        return _ACTIONS[args.action](store, options, args)
    except (CacheError, CacheOptionsError, OSError) as exc:
        print(f"kiln cache {args.action}: {exc}")
        return 1


def _list(store: CacheStore, options: CacheOptions, args) -> int:
    print(f"{'key':<12} {'graph':<44} {'size':>9} {'compile':>8}  last used")
    for key, entry, problem in store.headers():
        if entry is None:
            print(f"{key[:12]:<12} UNREADABLE: {problem}")
            continue
        print(f"{key[:12]:<12} {str(entry.fields.get('label', ''))[:44]:<44} {entry.size / 2**20:>7.1f}Mi "
              f"{entry.compile_seconds:>7.1f}s  {_when(entry.last_used)}")
    print(describe_cache(options).text)
    return 0


def _info(store: CacheStore, options: CacheOptions, args) -> int:
    if not args.key:
        print(describe_cache(options).text)
        print(f"signing key: {store.key_path} (only entries signed with it are loaded)")
        return 0
    (key,) = _resolve(store, [args.key])
    entry = store.read(key)  # verifies the signature
    print(f"entry {key}: {entry.size / 2**20:.1f} MiB, {len(entry.files)} files, signature OK, "
          f"compiled in {entry.compile_seconds:.1f}s on {_when(entry.created)}")
    print(json.dumps(entry.fields, indent=2, sort_keys=True))
    device = str(entry.fields.get("device", "cpu")).split(" ")[0]
    # the environment fields the entry is keyed by (a record may be keyed by fewer than a graph)
    here = {name: value for name, value in environment_fields(device).items() if name in entry.fields}
    stale = differences(here, {name: entry.fields[name] for name in here})
    print("usable on this machine" if not stale else "NOT usable on this machine: " + "; ".join(stale))
    return 0


def _clear(store: CacheStore, options: CacheOptions, args) -> int:
    keys = _resolve(store, args.keys) if args.keys else store.keys()
    removed = sum(store.remove(key) for key in keys)
    print(f"removed {removed} entries from {store.entries}")
    return 0


def _export(store: CacheStore, options: CacheOptions, args) -> int:
    count = store.export(_resolve(store, args.keys), args.file)
    print(f"exported {count} entries to {args.file}; on the other machine: kiln cache import {args.file}")
    return 0


def _import(store: CacheStore, options: CacheOptions, args) -> int:
    entries = store.import_(args.file)
    for entry in entries:
        print(f"imported {entry.key[:12]} {entry.fields.get('label', '')} ({entry.fields.get('device')}, torch "
              f"{entry.fields.get('torch')})")
    print(f"{len(entries)} entries signed with this cache's key: Kiln will load their code")
    return 0


_ACTIONS = {"list": _list, "info": _info, "clear": _clear, "export": _export, "import": _import}
