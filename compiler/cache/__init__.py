"""Kiln's compile cache: signed entries of what Inductor produced, keyed by everything that decides reuse.

See graph_cache.py for how a lowering uses it, key.py for what an entry's key holds, trust.py for
who may put code in it, location.py for where it and its signing key live, entry.py for one
entry's bytes, store.py for the directory. No ComfyUI here.
"""
from .describe import cache_problem, describe_cache
from .graph_cache import CacheEvent, GraphCache
from .key import choice_fields, differences, entry_fields, entry_key, environment_fields, explain_miss, graph_hash
from .location import CacheLocationError, default_cache_dir, server_cache_dir
from .options import CACHE_MODES, CacheOptions, CacheOptionsError
from .store import CacheEntryError, CacheStore, Entry
from .trust import CacheError, CacheTrustError

__all__ = ["cache_problem", "describe_cache", "CacheEvent", "GraphCache", "CacheOptions", "CacheOptionsError", "CACHE_MODES",
           "default_cache_dir", "server_cache_dir", "CacheStore", "Entry", "CacheError", "CacheEntryError",
           "CacheTrustError", "CacheLocationError", "choice_fields", "entry_fields", "entry_key",
           "environment_fields", "explain_miss", "differences", "graph_hash"]
