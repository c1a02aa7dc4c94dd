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
from outrate.budget.quota import Spent, Usage, spent
from outrate.budget.quotafile import read_usage

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

    def spent(self, rule: Limit, user: str) -> Spent | None:
        """The user's spent quota under `rule` (not in shadow), or None."""
        if not rule.quotas or rule.shadow:
            return None
        return spent(rule.quotas, self.usage(user), self.clock())


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
