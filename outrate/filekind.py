"""What a path is when it is not a regular file: the words every refusal uses.

`policy_file` (policies, keys files) and `trace` (`--outrate-trace`) refuse
the same kinds of file, and say so in the same words."""

from __future__ import annotations

import stat

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """`a FIFO`, `a directory`, ... for `mode` (an `st_mode`); `not a file` else."""
    return next((name for test, name in _KINDS if test(mode)), "not a file")
