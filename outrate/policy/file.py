"""Reading a policy file's bytes: the one place a policy file is opened.

`outrate lint`, the engine at startup and the engine's reload thread all read
through `read_policy_file`, which is `outrate.fileread.read_bounded` with the
policy's limit (`max_policy_bytes()`): only a regular file, opened
non-blocking, at most that many bytes. Every failure is a PolicyError
located at the file, so it prints like any other policy error.
"""

from __future__ import annotations

import os

from outrate.env import MAX_POLICY_BYTES
from outrate.errors import PolicyError
from outrate.fileread import FileLimit, FileReadError, byte_limit, decode_text, read_bounded

MAX_POLICY_BYTES_ENV = MAX_POLICY_BYTES
DEFAULT_MAX_POLICY_BYTES = 64 * 1024 * 1024
"""About a million users written as `user-0123456: {rate: 100, max_streams: 4}`."""

POLICY_FILE = FileLimit("a policy file", DEFAULT_MAX_POLICY_BYTES, MAX_POLICY_BYTES)
"""Policies and keys files (a keys file is part of its policy)."""


def max_policy_bytes(source: str = "<policy>") -> int:
    """The read limit: `$OUTRATE_MAX_POLICY_BYTES`, or 64 MiB."""
    try:
        return byte_limit(POLICY_FILE, source)
    except FileReadError as e:
        raise PolicyError([e.problem]) from e.__cause__ or e


def read_policy_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a policy file (lint, startup and the reloader alike)."""
    try:
        return read_bounded(path, POLICY_FILE)
    except FileReadError as e:
        raise PolicyError([e.problem]) from e.__cause__ or e


def decode_policy_bytes(raw: bytes, source: str) -> str:
    """UTF-8 with an optional BOM, or a located error."""
    try:
        return decode_text(raw, source)
    except FileReadError as e:
        raise PolicyError([e.problem]) from e.__cause__ or e
