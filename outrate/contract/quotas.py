"""Token quotas in the API server: is this user's quota spent?

The engine core counts usage and saves it to the quota file every
`SAVE_INTERVAL_S` (outrate.budget.quotafile); each API-server process reads
that file, at most every `READ_INTERVAL_S` and only when it changed, and
refuses (429, `insufficient_quota`, Retry-After up to the window's reset)
a new request of a user whose quota in force is spent. The decision lags
the engine by at most the engine's fold (0.25 s), its save and this read:
about 1 s. What streams already admitted produce meanwhile, and after, is
counted (never cut) and stays in that window's usage.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from outrate.budget.gcra import Limit
from outrate.budget.quota import (
    WINDOWS,
    QuotaLeft,
    Spent,
    Usage,
    quota_state,
    spent_of,
    used_in,
    window_bounds,
)
from outrate.budget.quotafile import read_usage
from outrate.policy.compiler import CompiledPolicy

READ_INTERVAL_S = 0.2


class QuotaView:
    """One API server's view of the quota file."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.users: dict[str, Usage] = {}
        self._next = 0.0
        self._mtime: float | None = None

    def usage(self, user: str) -> Usage:
        now = self.clock()
        if now >= self._next:
            self._next = now + READ_INTERVAL_S
            self._refresh()
        return self.users.get(user, {})

    def _refresh(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        try:
            self.users = read_usage(self.path)[0]
            self._mtime = mtime
        except (OSError, ValueError):  # FileReadError is an OutrateError, a ValueError
            return  # keep the last good view

    def state(self, rule: Limit, user: str) -> list[QuotaLeft]:
        """Each quota in force for the user under `rule` (none in shadow),
        with what is left of it as counted (the file's last save)."""
        if not rule.quotas or rule.shadow:
            return []
        return quota_state(rule.quotas, self.usage(user), self.clock())

    def spent(self, rule: Limit, user: str) -> Spent | None:
        """The user's spent quota under `rule` (not in shadow), or None."""
        return spent_of(self.state(rule, user))


def quota_message(s: Spent) -> str:
    q = s.quota
    return (
        f"You exceeded your current quota: {q.tokens} {q.kind} tokens per {q.window} "
        f"(UTC), {s.used} used. It resets in {math.ceil(s.reset_s)}s."
    )


def quota_body(s: Spent) -> dict[str, Any]:
    return {
        "error": {
            "message": quota_message(s),
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        }
    }


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def usage_lines(
    users: dict[str, Usage], policy: CompiledPolicy | None = None, now_s: float | None = None
) -> list[str]:
    """`outrate quota`: one line per user and quota window of `users` (a
    quota file's, `read_usage`, or the store's, `UsageLink.all_usage`),
    `alice  output/day  120000 used  resets 2026-12-05T00:00:00Z`; with
    `policy`, each user's quota in force and what remains of it (a quota with
    no usage yet shows `0 used`). Windows that have passed are left out."""
    now = time.time() if now_s is None else now_s
    lines = []
    for user in sorted(users):
        usage = users[user]
        rows: dict[str, str] = {}
        for key in sorted(usage):
            kind, _, window = key.partition("/")
            used = used_in(usage, kind, window, now) if window in WINDOWS else 0
            if used:
                rows[key] = f"{used} used  resets {_utc(window_bounds(window, now)[1])}"
        if policy is not None:
            rule = policy.limit_for(user)
            for q in quota_state(rule.quotas, usage, now):
                rows[f"{q.quota.kind}/{q.quota.window}"] = (
                    f"{q.used} used of {q.quota.tokens} ({q.remaining} left, {rule.rule})  "
                    f"resets {_utc(now + q.reset_s)}"
                )
        lines += [f"{user}  {key}  {row}" for key, row in sorted(rows.items())]
    return lines
