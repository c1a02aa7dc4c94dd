"""The quota file (`--outrate-quota-file`): where each user's usage outlives
the engine, and how the API server learns that a quota is spent.

    {"version": 1, "saved": 1796378400.5,
     "users": {"alice": {"output/day": [1796342400, 120000]}},
     "resets": {"alice": 1796378000.0}}

The engine core is its one writer: it loads the file at start (a restart
keeps the current windows' usage) and saves its `QuotaBook` every
`SAVE_INTERVAL_S` from a thread of its own, atomically (a reader never
sees half a file). API servers only read it. An operator's reset
(`outrate quota --reset USER`) goes to a second file beside it,
`PATH.resets` (user -> time of the reset), which only the CLI writes: the
engine applies each reset newer than the last it applied (kept under
`resets` in the usage file, so a restart does not apply it twice), and the
CLI also drops the user from the usage file for an engine that is not
running.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from outrate.budget.quota import QuotaBook, Usage
from outrate.fileread import FileLimit, FileReadError, read_bounded

SAVE_INTERVAL_S = 1.0
"""How often the engine saves usage: what a crash loses at most, and (with
the API server's read) how late a spent quota is refused."""
QUOTA_FILE = FileLimit("a quota file", 256 * 1024 * 1024)
RESETS_SUFFIX = ".resets"


def write_json(path: str, data: dict[str, Any]) -> None:
    """Atomic: written beside, then renamed over."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any]:
    """A quota (or resets) file's content; {} when it does not exist yet.
    Raises FileReadError (unreadable) or ValueError (not our JSON)."""
    if not os.path.exists(path):
        return {}
    data = json.loads(read_bounded(path, QUOTA_FILE))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a quota file (a JSON object)")
    return data


def read_usage(path: str) -> tuple[dict[str, Usage], dict[str, float]]:
    """(users' usage, resets applied) of a quota file."""
    data = read_json(path)
    users = data.get("users", {})
    resets = data.get("resets", {})
    if not isinstance(users, dict) or not isinstance(resets, dict):
        raise ValueError(f"{path}: not a quota file ('users' and 'resets' are mappings)")
    return users, {str(k): float(v) for k, v in resets.items()}


def request_reset(path: str, user: str, now: float | None = None) -> bool:
    """The operator's reset of `user`: recorded for the running engine
    (`PATH.resets`) and applied to the usage file at once. Whether the file
    had usage of `user`."""
    now = time.time() if now is None else now
    resets_path = path + RESETS_SUFFIX
    resets = read_json(resets_path)
    resets[user] = now
    write_json(resets_path, resets)
    data = read_json(path)
    users = data.setdefault("users", {})
    had = users.pop(user, None) is not None
    data.setdefault("resets", {})[user] = now
    write_json(path, {"version": 1, **data})
    return had


class QuotaSaver:
    """Saves a `QuotaBook` to the quota file every `interval_s` from its own
    daemon thread (and once more on stop), after applying the operator's
    resets. Loads the file into the book at construction."""

    def __init__(
        self,
        path: str,
        book: QuotaBook,
        interval_s: float = SAVE_INTERVAL_S,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.path = path
        self.book = book
        self.interval_s = interval_s
        self.on_error = on_error
        users, self.applied = read_usage(path)
        book.load(users)
        self.saves = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def apply_resets(self) -> None:
        try:
            resets = read_json(self.path + RESETS_SUFFIX)
        except (FileReadError, ValueError):
            return
        for user, at in resets.items():
            if float(at) > self.applied.get(user, 0.0):
                self.book.reset(user)
                self.applied[user] = float(at)

    def save(self) -> None:
        try:
            self.apply_resets()
            if not self.book.changed and self.saves:
                return
            users = self.book.snapshot()
            data = {"version": 1, "saved": time.time(), "users": users, "resets": self.applied}
            write_json(self.path, data)
            self.saves += 1
        except Exception as e:  # noqa: BLE001 - a full disk must not stop inference
            self.errors += 1
            if self.on_error is not None:
                self.on_error(e)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="outrate-quota", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.save()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.save()
