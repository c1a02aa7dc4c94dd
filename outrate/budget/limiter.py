"""GCRA limiter: per-user theoretical arrival times in exact integer arithmetic.

The decision is `gcra()`, a pure function over integers. `Limiter` holds the
per-user table and an injected clock; it never sleeps and never reads the wall
clock on its own unless no `now` is passed.

Time is kept in *scaled units*: for a rate p/q tokens/s (a reduced fraction)
one nanosecond is `p` units and one token costs `1e9 * q` units, so any rate the
policy can express (fractions included) is paced exactly, with no rounding
drift over long runs. Each `Limit` carries its own scale; a user's state is the
theoretical arrival time (TAT) in its limit's units.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from decimal import Decimal
from fractions import Fraction
from typing import NamedTuple, Protocol

from outrate.units import format_duration, format_rate

NS_PER_S = 1_000_000_000
SWAP_HISTORY = 32
"""Policy swaps remembered so an idle bucket converts its debt at each swap instant."""


def exact_rate(value: int | float | str | Decimal | Fraction) -> Fraction:
    """The exact rate a human wrote: 0.1 is 1/10, not the nearest binary float."""
    if isinstance(value, Fraction):
        return value
    if isinstance(value, float):
        return Fraction(Decimal(repr(value)))
    if isinstance(value, str):  # '0.1' and '1/3' alike; junk is a ValueError
        try:
            return Fraction(value)
        except ZeroDivisionError as e:
            raise ValueError(f"rate {value!r} divides by zero") from e
    return Fraction(Decimal(str(value)))


_INTS: dict[int, int] = {}


def _shared_int(v: int) -> int:
    """One int object per value across all Limits: `take` reads three of them
    per token, and a policy of many rules with the same rate (one per listed
    user) then touches the same three objects instead of three per user."""
    if len(_INTS) > 100_000:
        _INTS.clear()
    return _INTS.setdefault(v, v)


class Limit:
    """One resolved limit: rate (None = unlimited), burst and stream cap.

    Immutable and shared by every user that resolves to the same rule, so it
    costs nothing per user. `scale`, `interval` and `tolerance` are the GCRA
    integers in this limit's scaled units (see module docstring).
    """

    __slots__ = (  # take's first: fewer cache lines per token
        "scale",
        "interval",
        "tolerance",
        "rate",
        "burst_ns",
        "max_streams",
        "rule",
        "shadow",
        "label",
    )

    def __init__(
        self,
        rate: Fraction | int | float | str | None,
        burst_ns: int,
        max_streams: int | None = None,
        rule: str = "",
        shadow: bool = False,
        label: str = "",
    ) -> None:
        if rate is not None:
            rate = exact_rate(rate)
            if rate <= 0:
                raise ValueError(f"rate must be > 0, got {rate}")
        if burst_ns <= 0:
            raise ValueError(f"burst must be > 0 ns, got {burst_ns}")
        if max_streams is not None and max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self.rate: Fraction | None = rate
        self.burst_ns = int(burst_ns)
        self.max_streams = max_streams
        self.rule = rule
        self.shadow = shadow
        """Computed and counted, never enforced: nobody is held, no prefill capped."""
        self.label = label
        """The `limit` label of this rule's metrics (`default`, `tier:pro`, ...)."""
        if rate is None:
            self.scale = 0
            self.interval = 0
            self.tolerance = 0
        else:
            self.scale = _shared_int(rate.numerator)
            self.interval = _shared_int(NS_PER_S * rate.denominator)
            self.tolerance = _shared_int(self.burst_ns * rate.numerator)

    @property
    def unlimited(self) -> bool:
        return self.rate is None

    def _key(self) -> tuple[Fraction | None, int, int | None, bool]:
        return (self.rate, self.burst_ns, self.max_streams, self.shadow)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Limit) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def describe(self) -> str:
        """Human form used in log lines: `20 tok/s burst 100ms` or `unlimited`."""
        if self.rate is None:
            text = "unlimited"
        else:
            text = f"{format_rate(self.rate)} tok/s burst {format_duration(self.burst_ns)}"
        if self.max_streams is not None:
            text += f" max_streams {self.max_streams}"
        if self.shadow:
            text += " (shadow)"
        return text

    def __repr__(self) -> str:
        return f"Limit({self.describe()!r}, rule={self.rule!r})"


def gcra(tat: int, now: int, interval: int, tolerance: int) -> int | None:
    """The GCRA decision. All arguments in one limit's scaled units.

    Returns the new TAT if one token may be taken at `now`, else None.
    A token is conforming when `tat - now <= tolerance`; a TAT in the past
    counts as `now` (an idle user is a fresh user).
    """
    if tat < now:
        tat = now
    elif tat - now > tolerance:
        return None
    return tat + interval


class Bucket:
    """A user's state: the TAT, plus what is needed to keep it valid.

    `limit` and `gen` let a policy swap be O(1): a bucket re-resolves its limit
    (carrying its debt in tokens) the next time it is touched. `pins` counts
    live requests holding this bucket, so cleanup never splits a user's state.
    """

    __slots__ = ("gen", "limit", "tat", "key", "pins")  # take's first

    def __init__(self, key: str, limit: Limit, gen: int) -> None:
        self.key = key
        self.tat = 0
        self.limit = limit
        self.gen = gen
        self.pins = 0


class Stats(NamedTuple):
    """What a user of redis-cell or throttled-py expects to see."""

    limit: Limit
    remaining: int
    """Tokens that could be taken right now, back to back; -1 when unlimited."""
    retry_after_ns: int
    """0 when a token can be taken now."""
    ready_at_ns: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class LimitSource(Protocol):
    """What the limiter needs of a policy (outrate.policy.compiler.CompiledPolicy is one):
    the limiter sits below the compiler and never imports it."""

    def limit_for(self, user_id: str) -> Limit: ...


class Limiter:
    """The per-user table. One per engine; only the scheduler thread mutates it."""

    _bucket_cls: type[Bucket] = Bucket
    """What `bucket` creates (a shared store's buckets carry its credit)."""

    def __init__(self, policy: LimitSource, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._policy = policy
        self._gen = 0
        self._swaps: deque[tuple[int, int | None, LimitSource]] = deque(maxlen=SWAP_HISTORY)
        self._buckets: dict[str, Bucket] = {}
        self._sweep: deque[str] = deque()
        self._pinned = 0  # buckets with pins (cleanup never drops them)
        self.clock = clock

    # -- policy ------------------------------------------------------------

    @property
    def policy(self) -> LimitSource:
        return self._policy

    def set_policy(self, policy: LimitSource, now: int | None = None) -> None:
        """Swap the policy in O(1); each bucket converts its debt when next touched,
        as it stood at `now`, the swap instant (None: at that touch).

        Debt is carried in tokens, not time: raising a rate pays the debt off
        faster at once; lowering a rate never grants a token the old rate would
        not have (nor one a fresh user under the new rate would not have). An
        idle user's debt is converted at the swap instant too, however late it
        is touched: the last `SWAP_HISTORY` swaps are remembered with their
        times, and a bucket older than all of them converts at its touch (its
        debt, at most a burst and a token, was long paid by then unless more
        than SWAP_HISTORY reloads came within one burst).
        """
        self._gen += 1
        self._swaps.append((self._gen, now, policy))
        self._policy = policy

    def _local(self, b: Bucket, lim: Limit) -> Limit:
        """The limit this table enforces for `b`'s user where the policy says
        `lim`: the same here; a shared store scales it by its engine's share."""
        return lim

    def _refresh(self, b: Bucket, now: int) -> None:
        at = now  # the limit in force applies from the last swap `b` missed, else now
        swaps = self._swaps
        if swaps and swaps[0][0] <= b.gen + 1:
            last = len(swaps) - 1
            for i, (gen, t, policy) in enumerate(swaps):  # every swap since b's generation
                if gen > b.gen:
                    at = now if t is None else min(t, now)
                    if i < last:
                        self._convert(b, self._local(b, policy.limit_for(b.key)), at)
        self._convert(b, self._local(b, self._policy.limit_for(b.key)), at)
        b.gen = self._gen

    @staticmethod
    def _convert(b: Bucket, new: Limit, at: int) -> None:
        """Carry `b`'s debt as it stood at `at` over to `new`, in tokens."""
        old = b.limit
        if new.scale == old.scale and new.interval == old.interval:
            b.limit = new  # same units: the TAT stands as it is
            return
        debt = b.tat - at * old.scale if old.scale else 0
        if debt > 0 and new.scale:
            b.tat = at * new.scale + _ceil_div(debt * new.interval, old.interval)
        else:
            b.tat = 0
        b.limit = new

    # -- the table ---------------------------------------------------------

    def bucket(self, user: str) -> Bucket:
        """The user's bucket, created on first use."""
        b = self._buckets.get(user)
        if b is None:
            b = self._bucket_cls(user, self._policy.limit_for(user), self._gen)
            self._buckets[user] = b
            self._sweep.append(user)
        return b

    def pin(self, user: str) -> Bucket:
        """Take a reference a request can keep; cleanup will not drop it."""
        b = self.bucket(user)
        if not b.pins:
            self._pinned += 1
        b.pins += 1
        return b

    def unpin(self, b: Bucket) -> None:
        b.pins -= 1
        if not b.pins:
            self._pinned -= 1

    def limit_of(self, b: Bucket, now: int) -> Limit:
        if b.gen != self._gen:
            self._refresh(b, now)
        return b.limit

    # -- hot path ----------------------------------------------------------

    def take(self, b: Bucket, now: int) -> bool:
        """Take one token from `b` at `now` (ns) if it conforms. O(1), no allocation
        beyond the new TAT integer. Same decision as `gcra()`, inlined. The
        scheduler's hook inlines it once more for a `Limiter` (not a subclass
        that overrides `take_upto`) while `b.gen == self._gen`: keep the two
        alike (tests/test_scheduler.py checks they decide alike)."""
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        s = lim.scale
        if not s:
            return True
        now_s = now * s
        tat = b.tat
        if tat < now_s:
            tat = now_s
        elif tat - now_s > lim.tolerance:
            return False
        b.tat = tat + lim.interval
        return True

    def take_upto(self, b: Bucket, now: int, n: int) -> int:
        """Take up to `n` tokens from `b` at `now`: as many as `n` successful
        `take`s at `now` back to back would, in one call. Returns how many (0
        when even one would not conform). The scheduler takes a user's tokens
        for a step with it and gives back what the step did not use."""
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        s = lim.scale
        if not s:
            return n
        now_s = now * s
        tat = b.tat
        if tat < now_s:
            tat = now_s
        elif tat - now_s > lim.tolerance:
            return 0
        if n == 1:  # (as `take`)
            b.tat = tat + lim.interval
            return 1
        if n <= 0:
            return 0
        i = lim.interval
        k = (lim.tolerance - (tat - now_s)) // i + 1  # takes that conform back to back
        if k < n:
            n = k
        b.tat = tat + n * i
        return n

    def give_back(self, b: Bucket, now: int, n: int = 1) -> None:
        """Undo `n` tokens of `take`s that succeeded (the refund point; a step's
        unused tokens)."""
        if b.gen != self._gen:
            self._refresh(b, now)
        b.tat -= b.limit.interval if n == 1 else n * b.limit.interval

    def ready_at(self, b: Bucket, now: int) -> int:
        """Earliest time (ns) at which `take(b)` succeeds; `now` if it does now."""
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        if not lim.scale:
            return now
        t = _ceil_div(b.tat - lim.tolerance, lim.scale)
        return t if t > now else now

    def available(self, b: Bucket, now: int) -> int:
        """Tokens `b` could take at `now` back to back (its remaining burst).

        Unlimited buckets answer a number larger than any step can use.
        """
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        if not lim.scale:
            return 1 << 30
        now_s = now * lim.scale
        ahead = b.tat - now_s if b.tat > now_s else 0
        if ahead > lim.tolerance:
            return 0
        return (lim.tolerance - ahead) // lim.interval + 1

    # -- keyed verbs (API for tools and tests) -----------------------------

    def _now(self, now: int | None) -> int:
        return self.clock() if now is None else now

    def try_take(self, user: str, now: int | None = None) -> bool:
        return self.take(self.bucket(user), self._now(now))

    def refund(self, user: str, now: int | None = None) -> None:
        self.give_back(self.bucket(user), self._now(now))

    def ready_at_ns(self, user: str, now: int | None = None) -> int:
        now = self._now(now)
        b = self._buckets.get(user)
        return now if b is None else self.ready_at(b, now)

    def stats(self, user: str, now: int | None = None) -> Stats:
        now = self._now(now)
        b = self._buckets.get(user)
        lim = self._policy.limit_for(user) if b is None else self.limit_of(b, now)
        if not lim.scale:
            return Stats(lim, -1, 0, now)
        if b is None:
            return Stats(lim, lim.tolerance // lim.interval + 1, 0, now)
        remaining = self.available(b, now)
        ready = self.ready_at(b, now)
        return Stats(lim, remaining, ready - now, ready)

    # -- housekeeping ------------------------------------------------------

    def cleanup(self, now: int | None = None, budget: int = 64) -> int:
        """Drop up to `budget` examined idle users; bounded work per call.

        A user whose TAT is not ahead of `now` is indistinguishable from a user
        never seen, so dropping it changes no decision. Pinned buckets stay.
        """
        sweep, buckets = self._sweep, self._buckets
        if len(buckets) == self._pinned:
            return 0  # every user has live requests: nobody to forget (each step's case)
        now = self._now(now)
        removed = 0
        for _ in range(min(budget, len(sweep))):
            key = sweep.popleft()
            b = buckets[key]
            if b.pins == 0 and self._forgettable(b, now):
                del buckets[key]
                removed += 1
            else:
                sweep.append(key)
        return removed

    def _forgettable(self, b: Bucket, now: int) -> bool:
        """An unpinned bucket whose TAT is not ahead of `now` holds nothing."""
        return b.tat <= now * b.limit.scale

    def __len__(self) -> int:
        return len(self._buckets)

    def __contains__(self, user: object) -> bool:
        return user in self._buckets

    def export(self, now: int | None = None) -> Iterator[tuple[str, Stats]]:
        """Every known user's stats: the hook for metrics and shared budgets."""
        now = self._now(now)
        for key in list(self._buckets):
            yield key, self.stats(key, now)
