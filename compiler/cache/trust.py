"""Who may put code in Kiln's cache: the user, and only through Kiln.

Loading a cache entry runs code (Inductor's entries are pickles and generated modules), so Kiln
loads only entries signed with the user's own key, which lives in one fixed per-user place
(location.py: ~/.config/kiln/cache-signing.key, 0600), never in the cache directory: whoever can
put files into a cache directory still cannot sign them. The directory itself must be the user's,
reached through folders that only the user (or root) can change, and written by nobody else
(created 0700): an entry someone else planted, or one copied in from elsewhere without `kiln
cache import`, fails its signature and is refused. Nothing here follows a symbolic link.

On Windows, POSIX owners and modes do not exist and Kiln does not read ACLs: the signature is
the whole check there (the key sits in %APPDATA%, which Windows makes private to the user).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from typing import BinaryIO

SIGNATURE_BYTES = 32  # HMAC-SHA256
KEY_BYTES = 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a pipe never waits for a writer
_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation

log = logging.getLogger("kiln")


class CacheError(RuntimeError):
    """Kiln's cache cannot be used as asked, or an entry cannot be; the message says why. A model
    then compiles without the cache (or without that entry)."""


class CacheTrustError(CacheError):
    """The cache directory or its key cannot be trusted; the message says why and what to do."""


def _posix() -> bool:
    return os.name == "posix"


_said_what_windows_leaves_unchecked = False


def say_what_is_unchecked() -> None:
    """On Windows, say once in the log what Kiln does not check there."""
    global _said_what_windows_leaves_unchecked
    if not _posix() and not _said_what_windows_leaves_unchecked:
        _said_what_windows_leaves_unchecked = True
        log.warning("Kiln: on Windows Kiln does not check the cache directory's owner or ACL: it loads only entries "
                    "signed with your key in %APPDATA%\\kiln, but anyone who can write the cache directory can "
                    "delete or replace entries there (they are then refused and compiled again)")


def ensure_private_dir(path: str, check_parents: bool = True) -> str:
    """Create `path` (0700) if missing; refuse one that is a symbolic link, that another user owns or
    others can write, or (`check_parents`) whose parents someone else could change."""
    if check_parents:
        check_parent_dirs(path)
    if not os.path.lexists(path):
        _make_private_dirs(path)
        if check_parents:  # the folders made on the way, and any another process made meanwhile
            check_parent_dirs(path)
    check_private(path, "directory")
    if not os.path.isdir(path):
        raise CacheTrustError(f"Kiln's cache directory {path} is a file, not a directory: choose another cache_dir")
    return path


def _make_private_dirs(path: str) -> None:
    """Create `path` and each missing folder above it, each 0700 (makedirs gives only the last its mode,
    the others the umask's: 0775 under umask 002, which check_parent_dirs then refuses). A folder that
    another process made meanwhile is left as it is."""
    missing, here = [], os.path.abspath(path)
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        missing.append(here)
        here = os.path.dirname(here)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        if _posix():
            os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask


def check_parent_dirs(path: str) -> None:
    """CacheTrustError unless every existing folder above `path` belongs to this user or root and is
    not writable by others (a sticky folder such as /tmp excepted): else someone else could swap
    the cache directory for their own."""
    if not _posix():
        return
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.lexists(parent):
            info = os.lstat(parent)
            mode = stat.S_IMODE(info.st_mode)
            if info.st_uid not in (0, os.getuid()):
                raise CacheTrustError(f"Kiln's cache directory {path} lies in {parent}, which belongs to uid "
                                      f"{info.st_uid}: they could replace it; choose a directory in folders of your own")
            if mode & 0o022 and not mode & stat.S_ISVTX:
                raise CacheTrustError(f"Kiln's cache directory {path} lies in {parent}, which other users can write "
                                      f"(mode {mode:04o}): they could replace it; run chmod go-w {parent} or choose "
                                      "another directory")
        above = os.path.dirname(parent)
        if above == parent:
            return
        parent = above


def check_private(path: str, what: str) -> None:
    """Raise CacheTrustError unless `path` is no symbolic link, belongs to this user and no one else
    can write it (a key file: read it either); anything but a "directory" must be a regular file."""
    if not _posix():
        return
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise CacheTrustError(f"Kiln's cache {what} {path} is a symbolic link: Kiln reads and writes compiled code only "
                              "in real files and folders of its own; remove the link")
    if what != "directory" and not stat.S_ISREG(info.st_mode):
        raise _not_a_file(path, what)
    if info.st_uid != os.getuid():
        raise CacheTrustError(f"Kiln's cache {what} {path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): "
                              "Kiln will not load compiled code from it; choose a cache_dir of your own")
    forbidden = 0o077 if what == "key" else 0o022
    mode = stat.S_IMODE(info.st_mode)
    if mode & forbidden:
        who = "read or written" if what == "key" else "written"
        raise CacheTrustError(f"Kiln's cache {what} {path} can be {who} by other users (mode {mode:04o}): Kiln will not "
                              f"load compiled code from it; run chmod {'600' if what == 'key' else '700'} {path}")


def open_private(path: str, what: str) -> BinaryIO:
    """`path` opened for reading once check_private allows it: never through a symbolic link, never
    waiting on a pipe (O_NONBLOCK, which changes nothing for a regular file), and only a regular file.
    CacheTrustError says what is wrong; FileNotFoundError if there is none."""
    check_private(path, what)
    f = os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _BINARY), "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped meanwhile, or on Windows
        f.close()
        raise _not_a_file(path, what)
    return f


def _not_a_file(path: str, what: str) -> CacheTrustError:
    return CacheTrustError(f"Kiln's cache {what} {path} is not a regular file (a pipe, device or folder): Kiln reads "
                           "compiled code only from files of its own; remove it")


def signing_key(path: str) -> bytes:
    """The per-user key at `path`, made on first use (0600, in a 0700 folder). Two processes making
    it at once agree on one: the key is written aside and linked into place, which fails if another
    got there first."""
    ensure_private_dir(os.path.dirname(path))
    if not os.path.lexists(path):
        temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _BINARY, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
            try:
                os.link(temp, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(temp)
        log.info("Kiln: made the cache signing key %s", path)
    with open_private(path, "key") as f:
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise CacheTrustError(f"Kiln's cache key {path} is damaged ({len(key)} bytes, not {KEY_BYTES}): delete it; the "
                              "entries signed with it will then be refused and compiled again")
    return key


def signer(key: bytes):
    """An HMAC-SHA256 to feed an entry's bytes piece by piece (`update`); its `digest()` is `sign`'s."""
    return hmac.new(key, digestmod=hashlib.sha256)


def sign(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()

