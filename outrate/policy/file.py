"""Reading a policy file's bytes: the one place a policy file is opened.

`outrate lint`, the engine at startup and the engine's reload thread all read
through `read_policy_file`, so one rule holds everywhere: only a regular file
is read, it is opened non-blocking (a FIFO or a device never blocks the
reader: it is refused before any byte is read), and at most
`max_policy_bytes()` bytes are read (a symlink to /dev/zero or a file that
keeps growing cannot take the engine's memory). Every failure is a
PolicyError located at the file, so it prints like any other policy error.
"""

from __future__ import annotations

import os
import stat
from typing import NoReturn

from outrate.env import MAX_POLICY_BYTES, Env
from outrate.errors import PolicyError, Problem
from outrate.filekind import file_kind

MAX_POLICY_BYTES_ENV = MAX_POLICY_BYTES
DEFAULT_MAX_POLICY_BYTES = 64 * 1024 * 1024
"""About a million users written as `user-0123456: {rate: 100, max_streams: 4}`."""

_CHUNK = 1 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


def _fail(source: str, message: str, cause: BaseException | None = None) -> NoReturn:
    raise PolicyError([Problem(source, 1, 1, "<file>", f"cannot read: {message}")]) from cause


def max_policy_bytes(source: str = "<policy>") -> int:
    """The read limit: `$OUTRATE_MAX_POLICY_BYTES`, or 64 MiB."""
    raw = Env.read().max_policy_bytes.strip()
    if not raw:
        return DEFAULT_MAX_POLICY_BYTES
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    _fail(source, f"{MAX_POLICY_BYTES_ENV}={raw!r} is not a whole number of bytes > 0")


def _check_kind(source: str, st: os.stat_result) -> None:
    if stat.S_ISREG(st.st_mode):
        return
    _fail(source, f"not a regular file ({file_kind(st.st_mode)})")


def _too_big(source: str, what: str, limit: int) -> NoReturn:
    change = f"set {MAX_POLICY_BYTES_ENV} to change it"
    _fail(source, f"{what} the limit of {limit} bytes ({change})")


def read_policy_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a policy file (lint, startup and the reloader alike)."""
    source = os.fspath(path)
    limit = max_policy_bytes(source)
    try:
        _check_kind(source, os.stat(source))  # follows symlinks, as open() does
        fd = os.open(source, _OPEN_FLAGS)  # never blocks, even if swapped for a FIFO meanwhile
    except OSError as e:
        _fail(source, e.strerror or str(e), e)
    try:
        st = os.fstat(fd)
        _check_kind(source, st)
        if st.st_size > limit:
            _too_big(source, f"{st.st_size} bytes is more than", limit)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # it grew while we read
            _too_big(source, "it grew past", limit)
        return b"".join(chunks)
    except OSError as e:
        _fail(source, e.strerror or str(e), e)
    finally:
        os.close(fd)


def decode_policy_bytes(raw: bytes, source: str) -> str:
    """UTF-8 with an optional BOM, or a located error."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        _fail(source, f"not UTF-8 text ({e.reason} at byte {e.start})", e)
