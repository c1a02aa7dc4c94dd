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

With `--outrate-store` the store holds the usage (outrate.budget.shared.usage):
each save first syncs this engine's counts there (`Share`) and learns every
engine's, and the file keeps this engine's own counts (`own`), its quota id
(`quota_id`: a restart goes on writing the same count in the store), the
reset marks it applied (`marks`), and under `users` the count over every
engine, which is what the API server reads. A store that does not answer
stops nothing: the engine counts on, the others' counts stay as last
learnt, and the next sync that answers settles all (`FULL_SYNC_S`).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from outrate.budget.quota import QuotaBook, Usage
from outrate.fileread import FileLimit, FileReadError, read_bounded

SAVE_INTERVAL_S = 1.0
"""How often the engine saves usage: what a crash loses at most, and (with
the API server's read) how late a spent quota is refused."""
QUOTA_FILE = FileLimit("a quota file", 256 * 1024 * 1024)
RESETS_SUFFIX = ".resets"
FULL_SYNC_S = 5.0
"""With a store: every user's count is synced at least this often (those
that changed, every save), so an engine learns the others' counts of users
idle here, and a store that lost its state is written back."""


class Totals(Protocol):
    mark: int
    """The user's reset mark in the store (server us; 0: never reset)."""
    usage: Usage
    """Per window key, [start, the count over every engine]."""


class Share(Protocol):
    """Where usage is shared (outrate.budget.shared.usage.UsageLink)."""

    url: str
    quota_id: str

    def sync(self, rows: dict[str, Usage], applied: dict[str, int]) -> dict[str, Any]: ...

    def reset(self, user: str) -> int: ...

    def close(self) -> None: ...


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
    own = data.get("own")
    if isinstance(own, dict):
        # A store's: not marked applied, so an engine not running applies it
        # at its start, in the store too (every engine's count).
        own.pop(user, None)
    else:
        data.setdefault("resets", {})[user] = now
    write_json(path, {"version": 1, **data})
    return had


class QuotaSaver:
    """Saves a `QuotaBook` to the quota file every `interval_s` from its own
    daemon thread (and once more on stop), after applying the operator's
    resets. Loads the file into the book at construction. With `share` (a
    store), syncs the book there first (module docstring)."""

    def __init__(
        self,
        path: str,
        book: QuotaBook,
        interval_s: float = SAVE_INTERVAL_S,
        on_error: Callable[[Exception], None] | None = None,
        share: Share | None = None,
        on_share: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.book = book
        self.interval_s = interval_s
        self.on_error = on_error
        self.share = share
        self.on_share = on_share
        """Told each change of the store's state (lost, back), once each."""
        self.clock = clock
        data = read_json(path)
        users, self.applied = read_usage(path)
        own = data.get("own")
        book.load(own if isinstance(own, dict) else users)
        self.others: dict[str, Usage] = {}
        """Per user, what the other engines counted, as the store last said."""
        if isinstance(own, dict):  # the others' counts as last learnt: a restart keeps them
            for user, rows in users.items():
                mine = own.get(user, {})
                for key, (start, tokens) in rows.items():
                    row = mine.get(key)
                    n = tokens - (row[1] if row and row[0] == start else 0)
                    if n > 0:
                        self.others.setdefault(user, {})[key] = [start, n]
        self.quota_id = str(data.get("quota_id") or uuid.uuid4().hex)
        marks = data.get("marks", {})
        self.marks: dict[str, int] = {str(k): int(v) for k, v in marks.items()}
        """The store's reset mark of each user this engine's counts follow."""
        self._store_resets: list[str] = []
        self._last_full = -FULL_SYNC_S
        self.shared_up: bool | None = None
        self.syncs = 0
        self.sync_errors = 0
        if share is not None:
            share.quota_id = self.quota_id
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
                if self.share is not None:
                    self._store_resets.append(user)  # every engine's count goes

    def save(self) -> None:
        try:
            self.apply_resets()
            if self.share is not None:
                self._sync()
            elif not self.book.changed and self.saves:
                return
            own = self.book.snapshot()
            data: dict[str, Any] = {"version": 1, "saved": time.time(), "resets": self.applied}
            if self.share is None:
                data["users"] = own
            else:
                data["users"] = merged(own, self.others)
                data.update(own=own, quota_id=self.quota_id, marks=self.marks)
            write_json(self.path, data)
            self.saves += 1
        except Exception as e:  # noqa: BLE001 - a full disk must not stop inference
            self.errors += 1
            if self.on_error is not None:
                self.on_error(e)

    def _sync(self) -> None:
        """One round trip to the store: the resets asked for, then this
        engine's counts of the users that changed (of every user, each
        `FULL_SYNC_S` and after a failure), and what every engine counted."""
        share = self.share
        assert share is not None
        dirty, self.book.dirty = self.book.dirty, set()
        now = self.clock()
        full = now - self._last_full >= FULL_SYNC_S
        own = self.book.current()  # (passed windows left out: never written)
        chosen = own if full else {u: own[u] for u in dirty if u in own}
        try:
            while self._store_resets:
                user = self._store_resets[0]
                self.marks[user] = share.reset(user)  # this engine's count went already
                self._store_resets.pop(0)
            totals = share.sync(chosen, self.marks)
        except Exception as e:  # noqa: BLE001 - a store away never stops inference
            self.sync_errors += 1
            self.book.dirty |= dirty
            self._last_full = -FULL_SYNC_S  # all of it once it answers
            if self.shared_up is not False and self.on_share is not None:
                self.on_share(
                    f"budget store {share.url} did not take quota usage ({type(e).__name__}: "
                    f"{e}): counting on here; the other engines' usage stays as last learnt "
                    "until it answers"
                )
            self.shared_up = False
            return
        if self.shared_up is False and self.on_share is not None:
            self.on_share(f"budget store {share.url} is back: quota usage settled")
        self.shared_up = True
        self.syncs += 1
        if full:
            self._last_full = now
        for user, t in totals.items():
            if t.mark > self.marks.get(user, 0):  # the operator reset this user
                self.book.reset(user)
                self.marks[user] = t.mark
                self.others.pop(user, None)
                continue
            mine = own.get(user, {})
            others = {}
            for key, (start, total) in t.usage.items():
                row = mine.get(key)
                n = total - (row[1] if row and row[0] == start else 0)
                if n > 0:
                    others[key] = [start, n]
            if others:
                self.others[user] = others
            else:
                self.others.pop(user, None)

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
        if self.share is not None:
            self.share.close()


def merged(own: dict[str, Usage], others: dict[str, Usage]) -> dict[str, Usage]:
    """Per user and window, this engine's count plus the others' (as last
    learnt, in the same window): the usage the API server judges by."""
    out = {u: {k: list(v) for k, v in rows.items()} for u, rows in own.items()}
    for user, rows in others.items():
        mine = out.setdefault(user, {})
        for key, (start, n) in rows.items():
            row = mine.get(key)
            if row is None:
                mine[key] = [start, n]
            elif row[0] == start:
                row[1] += n
    return out
