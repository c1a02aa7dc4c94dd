"""Reading a file outrate was handed: the one place such a file is opened.

Policies, keys files, workloads, step models, vLLM `--config` files and
traces all come through here, so one rule holds for each: only a regular
file is read; it is opened non-blocking, so a FIFO or a device never blocks
the reader (it is refused before any byte is read); and at most the file
kind's `FileLimit` is read, so a symlink to /dev/zero or a file that keeps
growing cannot take the process's memory. A line reader (traces) also
bounds each line. Every failure is a `FileReadError` holding one located
`Problem` (`path:1:1: <file>: cannot read: ...`); callers turn it into their
own error type (a policy's `PolicyError`, a workload's `WorkloadError`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import NamedTuple, NoReturn

from outrate.env import Env
from outrate.errors import OutrateError, Problem
from outrate.filekind import file_kind

MIB = 1024 * 1024
_CHUNK = MIB
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


class FileLimit(NamedTuple):
    """How much of one kind of file is read."""

    what: str
    """The kind, for messages: `a policy file`, `a trace`."""
    default: int
    """Bytes read at most, unless `env` says otherwise."""
    env: str | None = None
    """The variable that changes the limit (an `outrate.env` name), or None: fixed."""
    line: int | None = None
    """Bytes in one line at most (line readers only)."""


class FileReadError(OutrateError):
    """A file that cannot be read; `problem` locates it (`problems` holds it
    too, as in every error made of located problems)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.problems: tuple[Problem, ...] = (problem,)
        super().__init__(str(problem))


def fail(source: str, message: str, cause: BaseException | None = None, line: int = 1) -> NoReturn:
    raise FileReadError(Problem(source, line, 1, "<file>", f"cannot read: {message}")) from cause


def byte_limit(limit: FileLimit, source: str) -> int:
    """`limit.default`, or the whole number of bytes its variable holds."""
    if limit.env is None:
        return limit.default
    raw = Env.read().file_limit(limit.env).strip()
    if not raw:
        return limit.default
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    fail(source, f"{limit.env}={raw!r} is not a whole number of bytes > 0")


def _check_kind(source: str, st: os.stat_result) -> None:
    if stat.S_ISREG(st.st_mode):
        return
    fail(source, f"not a regular file ({file_kind(st.st_mode)})")


def _too_big(source: str, what: str, limit: FileLimit, size: int) -> NoReturn:
    change = f" (set {limit.env} to change it)" if limit.env else f" for {limit.what}"
    fail(source, f"{what} the limit of {size} bytes{change}")


def _open(source: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of a regular file, and its status."""
    try:
        _check_kind(source, os.stat(source))  # follows symlinks, as open() does
        fd = os.open(source, _OPEN_FLAGS)  # never blocks, even if swapped for a FIFO meanwhile
    except OSError as e:
        fail(source, e.strerror or str(e), e)
    try:
        st = os.fstat(fd)
        _check_kind(source, st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bounded(path: str | os.PathLike[str], limit: FileLimit) -> bytes:
    """The bytes of a file of the kind `limit` describes."""
    source = os.fspath(path)
    most = byte_limit(limit, source)
    fd, st = _open(source)
    try:
        if st.st_size > most:
            _too_big(source, f"{st.st_size} bytes is more than", limit, most)
        chunks: list[bytes] = []
        size = 0
        while size <= most:
            chunk = os.read(fd, min(_CHUNK, most + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > most:  # it grew while we read
            _too_big(source, "it grew past", limit, most)
        return b"".join(chunks)
    except OSError as e:
        fail(source, e.strerror or str(e), e)
    finally:
        os.close(fd)


def read_lines(path: str | os.PathLike[str], limit: FileLimit) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line without its newline) of a file of the kind
    `limit` describes, one at a time: its memory is one line (at most
    `limit.line` bytes) and one chunk, whatever the file holds."""
    source = os.fspath(path)
    most = byte_limit(limit, source)
    longest = limit.line if limit.line is not None else most
    fd, st = _open(source)
    try:
        if st.st_size > most:
            _too_big(source, f"{st.st_size} bytes is more than", limit, most)
        size, number, rest = 0, 0, b""
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except OSError as e:
                fail(source, e.strerror or str(e), e)
            if not chunk:
                break
            size += len(chunk)
            if size > most:
                _too_big(source, "it grew past", limit, most)
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                number += 1
                if len(line) > longest:
                    _long_line(source, number, longest)
                yield number, line
            if len(rest) > longest:
                _long_line(source, number + 1, longest)
        if rest:
            yield number + 1, rest
    finally:
        os.close(fd)


def _long_line(source: str, number: int, longest: int) -> NoReturn:
    fail(source, f"line {number} is longer than {longest} bytes", line=number)


def decode_text(raw: bytes, source: str) -> str:
    """UTF-8 with an optional BOM, or a located error."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        fail(source, f"not UTF-8 text ({e.reason} at byte {e.start})", e)
