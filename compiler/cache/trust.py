"""Who may put code in Kiln's cache: the directory's owner, and only through Kiln.

Loading a cache entry runs code (Inductor's entries are pickles and generated modules), so Kiln
loads entries only from a directory that belongs to the user and that nobody else can write
(created 0700), and only entries signed with a per-user key kept beside them (0600): an entry
someone else planted, or one copied in from elsewhere without `kiln cache import`, fails its
signature and is refused. On Windows, where POSIX owners and modes do not exist, the signature
is the whole check.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

KEY_FILE = "signing.key"
SIGNATURE_BYTES = 32  # HMAC-SHA256


class CacheTrustError(RuntimeError):
    """The cache directory or its key cannot be trusted; the message says why and what to do."""


def _posix() -> bool:
    return os.name == "posix"


def ensure_private_dir(path: str) -> str:
    """Create `path` (0700) if missing; refuse one that another user owns or others can write."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        if _posix():
            os.chmod(path, 0o700)  # makedirs' mode is filtered by the umask
    check_private(path, "directory")
    return path


def check_private(path: str, what: str) -> None:
    """Raise CacheTrustError unless `path` belongs to this user and no one else can write it (a key
    file: read it either)."""
    if not _posix():
        return
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise CacheTrustError(f"Kiln's cache {what} {path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): "
                              "Kiln will not load compiled code from it; choose a cache_dir of your own")
    forbidden = 0o077 if what == "key" else 0o022
    mode = stat.S_IMODE(info.st_mode)
    if mode & forbidden:
        who = "read or written" if what == "key" else "written"
        raise CacheTrustError(f"Kiln's cache {what} {path} can be {who} by other users (mode {mode:04o}): Kiln will not "
                              f"load compiled code from it; run chmod {'600' if what == 'key' else '700'} {path}")


def signing_key(root: str) -> bytes:
    """The per-user key in `root`, made on first use (0600). Two processes making it at once agree
    on one: the key is written aside and linked into place, which fails if another got there first."""
    path = os.path.join(root, KEY_FILE)
    if not os.path.exists(path):
        temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(temp, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(temp)
    check_private(path, "key")
    with open(path, "rb") as f:
        key = f.read()
    if len(key) != 32:
        raise CacheTrustError(f"Kiln's cache key {path} is damaged ({len(key)} bytes, not 32): delete it; the entries "
                              "signed with it will then be refused and compiled again")
    return key


def sign(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def verify(key: bytes, data: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(sign(key, data), signature)
