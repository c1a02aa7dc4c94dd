"""Where the engine-side trace may be written, and how the engine core opens it.

The path is checked where the flags are parsed (`check_trace_path`, before the
model loads; `outrate lint` runs it too) and opened by `open_trace_file` in
the engine core, which cannot block or follow a link even if the path was
swapped in between: outrate writes only to a regular file that is new, empty
or already a trace. The trace itself is trace.py's.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TextIO

from outrate.errors import OutrateError
from outrate.filekind import file_kind

TRACE_START = b'{"trace":"outrate"'
"""How every trace's first line begins (the header, written compact). A file
that begins otherwise is someone else's and is never overwritten."""

_NEVER_BLOCK = (
    os.O_NONBLOCK
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NOCTTY", 0)
)
"""A FIFO or device opens at once (and is then refused), a symlink fails."""


def _not_regular(where: str, mode: int) -> OutrateError:
    if stat.S_ISLNK(mode):
        return OutrateError(
            f"{where}: is a symbolic link (outrate does not follow links: name the file itself)"
        )
    if stat.S_ISDIR(mode):
        return OutrateError(f"{where}: is a directory")
    return OutrateError(f"{where}: is not a regular file ({file_kind(mode)})")


def _not_a_trace(where: str) -> OutrateError:
    return OutrateError(f"{where}: is not an outrate trace; refusing to overwrite it")


def _starts_as_trace(fd: int) -> bool:
    """Whether an open regular file is empty or begins like a trace (a header
    torn by a full disk included: shorter than TRACE_START, but its start)."""
    return TRACE_START.startswith(os.pread(fd, len(TRACE_START), 0))


def rank_path(path: str, suffix: str) -> str:
    """`trace.jsonl` -> `trace.dp1.jsonl`: where each data-parallel rank writes."""
    if not suffix:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}{suffix}{ext}"


def check_trace_path(path: str | os.PathLike[str]) -> Path:
    """The absolute path, if the trace may be written there; OutrateError
    `PATH: why` if not. Startup and `outrate lint` run it, so a bad path fails
    in a second with one line, not after the model loads (or never: a FIFO
    blocked the engine core in open()).

    Allowed: a path that does not exist, in an existing directory outrate can
    write to, or an existing regular file that is empty or an outrate trace
    (rewritten, as every start does). Refused: a symbolic link (not followed:
    the trace would replace whatever it points to), a directory, a FIFO, a
    socket or a device (/dev/full too), a missing parent (not created), a
    file that is not a trace. Links among the parent directories are
    followed, as in any path. "Can write" is `os.access`: the real user's
    permission, so root passes every mode bit, as its open() would."""
    abspath = Path(os.path.abspath(path))
    where, parent = str(abspath), abspath.parent
    try:
        parent_mode = os.stat(parent).st_mode
    except FileNotFoundError:
        raise OutrateError(f"{where}: directory {parent} does not exist") from None
    except NotADirectoryError:
        raise OutrateError(f"{where}: {parent} is not a directory") from None
    except OSError as e:
        raise OutrateError(f"{where}: cannot reach {parent}: {e.strerror or e}") from e
    if not stat.S_ISDIR(parent_mode):
        raise OutrateError(f"{where}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutrateError(f"{where}: directory {parent} is not writable")
    try:
        st = os.lstat(abspath)
    except FileNotFoundError:
        return abspath
    except OSError as e:
        raise OutrateError(f"{where}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(where, st.st_mode)
    if not os.access(abspath, os.W_OK):
        raise OutrateError(f"{where}: is not writable")
    if st.st_size:
        try:
            fd = os.open(abspath, os.O_RDONLY | _NEVER_BLOCK)
            try:
                trace = _starts_as_trace(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise OutrateError(f"{where}: cannot read: {e.strerror or e}") from e
        if not trace:
            raise _not_a_trace(where)
    return abspath


def open_trace_file(path: str) -> TextIO:
    """Open the trace for writing from the start, in the engine core. The
    path was checked at startup; this open holds the same rules whatever the
    path has become since: it never blocks (O_NONBLOCK), never follows a
    link (O_NOFOLLOW), and truncates only a regular file that is empty or a
    trace (checked on the open file, fstat and its first bytes)."""
    flags = os.O_RDWR | os.O_CREAT | _NEVER_BLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        kind = {errno.ELOOP: stat.S_IFLNK, errno.EISDIR: stat.S_IFDIR}.get(e.errno or 0)
        if kind is not None:
            raise _not_regular(path, kind) from e
        raise OutrateError(f"{path}: cannot open: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if not _starts_as_trace(fd):
            raise _not_a_trace(path)
        os.ftruncate(fd, 0)
    except OutrateError:
        os.close(fd)
        raise
    except OSError as e:
        os.close(fd)
        raise OutrateError(f"{path}: cannot open: {e.strerror or e}") from e
    # O_NONBLOCK stays set: it changes nothing for a regular file.
    return open(fd, "w", encoding="utf-8")
