"""Token quotas (`quota:` on a rule): how many output or prompt tokens a
user may have in one hour, day, week or month, and each user's usage.

Windows follow the UTC calendar: an hour starts on the hour, a day at 00:00
UTC, a week on Monday 00:00 UTC (ISO weeks), a month on its first day. A
calendar window is what a bill and a support ticket speak of ("today's
quota"), every engine and API server computes the same window from the wall
clock alone (no state to agree on: a restart, a second engine or the store
cannot give anyone a fresh day), and its reset is one instant a client can
be told (`Retry-After`). A rolling window would need each user's history
of the last day, and its "reset" is no single time.

`QuotaBook` is the usage of one engine: per user, per (kind, window), the
window's start and the tokens counted in it. It is plain data with an
injected wall clock; the scheduler thread adds to it, another thread saves
`book.snapshot()` (outrate.budget.quotafile). A window that has passed is
forgotten at the next add or read: usage never carries into the next window.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("output", "prompt")
WINDOWS = ("hour", "day", "week", "month")
_HOUR = 3600
_DAY = 86400


@dataclass(frozen=True, slots=True)
class Quota:
    """At most `tokens` tokens of `kind` (output or prompt) per calendar `window`."""

    kind: str
    tokens: int
    window: str

    def __str__(self) -> str:
        return f"{self.kind} {self.tokens}/{self.window}"


def window_bounds(window: str, now_s: float) -> tuple[int, int]:
    """The UTC calendar window holding `now_s` (Unix seconds): (start, end)."""
    t = int(now_s // 1)
    if window == "hour":
        start = t - t % _HOUR
        return start, start + _HOUR
    if window == "day":
        start = t - t % _DAY
        return start, start + _DAY
    if window == "week":  # 1970-01-01 was a Thursday: Monday is 3 days before
        start = t - (t + 3 * _DAY) % (7 * _DAY)
        return start, start + 7 * _DAY
    if window == "month":
        tm = time.gmtime(t)
        start = calendar.timegm((tm.tm_year, tm.tm_mon, 1, 0, 0, 0))
        year, month = (tm.tm_year + 1, 1) if tm.tm_mon == 12 else (tm.tm_year, tm.tm_mon + 1)
        return start, calendar.timegm((year, month, 1, 0, 0, 0))
    raise ValueError(f"unknown quota window {window!r}")


Usage = dict[str, list[int]]
"""`"output/day"` -> [window start (Unix s), tokens counted in it]."""


class QuotaBook:
    """Each user's usage of its quota windows. One thread adds; `snapshot`
    returns a copy another thread may write out."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.users: dict[str, Usage] = {}
        self.changed = False
        """Anything added since the last `snapshot` (the writer skips a save otherwise)."""
        self.dirty: set[str] = set()
        """Users added to or reset since the writer last took this set (it
        swaps in an empty one): whose counts a store needs now."""

    def add(self, user: str, kind: str, tokens: int, windows: Iterable[str]) -> None:
        """Count `tokens` of `kind` in each of `windows` (those the user's rule
        has a quota on). An overrun is counted like any token."""
        if not tokens:
            return
        now = self.clock()
        usage = self.users.setdefault(user, {})
        for window in windows:
            key = f"{kind}/{window}"
            start = window_bounds(window, now)[0]
            row = usage.get(key)
            if row is None or row[0] != start:
                usage[key] = [start, tokens]
            else:
                row[1] += tokens
        self.changed = True
        self.dirty.add(user)

    def used(self, user: str, kind: str, window: str) -> int:
        """Tokens counted in the current window (0 once it has passed)."""
        return used_in(self.users.get(user, {}), kind, window, self.clock())

    def reset(self, user: str) -> bool:
        """Forget `user`'s usage (an operator's reset). Whether it had any."""
        self.changed = True
        self.dirty.add(user)
        return self.users.pop(user, None) is not None

    def load(self, users: Mapping[str, Usage]) -> None:
        """Usage saved before a restart, added to what is counted now."""
        now = self.clock()
        for user, usage in users.items():
            mine = self.users.setdefault(user, {})
            for key, (start, tokens) in usage.items():
                window = key.partition("/")[2]
                if window not in WINDOWS or window_bounds(window, now)[0] != start:
                    continue  # a window that has passed
                row = mine.get(key)
                if row is None or row[0] != start:
                    mine[key] = [start, tokens]
                else:
                    row[1] += tokens

    def snapshot(self) -> dict[str, Usage]:
        """A copy of the current windows' usage (passed windows dropped)."""
        out = self.current()
        self.changed = False
        return out

    def current(self) -> dict[str, Usage]:
        """A copy of the current windows' usage, leaving `changed` as it is."""
        now = self.clock()
        out: dict[str, Usage] = {}
        for user, usage in list(self.users.items()):
            rows = {
                k: list(v)
                for k, v in list(usage.items())
                if window_bounds(k.partition("/")[2], now)[0] == v[0]
            }
            if rows:
                out[user] = rows
        return out


def used_in(usage: Mapping[str, list[int]], kind: str, window: str, now_s: float) -> int:
    """Tokens of `kind` counted in `window`'s current span, from a usage row."""
    row = usage.get(f"{kind}/{window}")
    if row is None or row[0] != window_bounds(window, now_s)[0]:
        return 0
    return int(row[1])


class Spent:
    """Which quota of a user is spent, if any, and when it resets."""

    __slots__ = ("quota", "used", "reset_s")

    def __init__(self, quota: Quota, used: int, reset_s: float) -> None:
        self.quota = quota
        self.used = used
        self.reset_s = reset_s
        """Seconds until the spent window ends (when the user may send again)."""


class QuotaLeft(NamedTuple):
    """One quota of a user now: what the header fields say."""

    quota: Quota
    used: int
    """Tokens counted in the current window (an overrun included)."""
    remaining: int
    """`quota.tokens - used`, never below 0."""
    reset_s: float
    """Seconds until the window ends."""
    window_s: int
    """The current window's length in seconds (a month's varies)."""


def quota_state(
    quotas: Iterable[Quota], usage: Mapping[str, list[int]], now_s: float
) -> list[QuotaLeft]:
    """Each quota with what is left of it now."""
    out = []
    for q in quotas:
        used = used_in(usage, q.kind, q.window, now_s)
        start, end = window_bounds(q.window, now_s)
        out.append(QuotaLeft(q, used, max(0, q.tokens - used), end - now_s, end - start))
    return out


def spent(quotas: Iterable[Quota], usage: Mapping[str, list[int]], now_s: float) -> Spent | None:
    """The spent quota that resets last (a user with two spent quotas may
    send again only when both are back), or None."""
    return spent_of(quota_state(quotas, usage, now_s))


def spent_of(state: Iterable[QuotaLeft]) -> Spent | None:
    """`spent` over a `quota_state` already taken."""
    worst: Spent | None = None
    for q in state:
        if q.remaining <= 0 and (worst is None or q.reset_s > worst.reset_s):
            worst = Spent(q.quota, q.used, q.reset_s)
    return worst
