"""The per-user table: `Limiter`, the in-memory `BudgetStore` (outrate.budget.store).

Every decision is `gcra()` (outrate.budget.gcra) over a user's `Bucket`: the
table holds the buckets, converts their debt when the policy changes, and
forgets idle users in bounded steps. The clock is injected: the table never
sleeps and reads the clock only where a caller passes no `now`.

A budget shared with other engines is this same table with a `Lender`
(outrate.budget.shared.credit.SharedBudget): it gives each bucket a credit
`Account` that takes must also fit in, and says which limit this engine
enforces (its share of the user's rate). The table consults it when a bucket
is created, at a first pin and a last unpin, and at step boundaries (`pin`,
`cleanup`), all on the scheduler's thread; per token it reads the bucket's
account and nothing else.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

from outrate.budget.gcra import NS_PER_S, Limit, exact_rate, gcra

__all__ = [
    "NS_PER_S",
    "Account",
    "Bucket",
    "Lender",
    "Limit",
    "LimitSource",
    "Limiter",
    "Stats",
    "exact_rate",
    "gcra",
]

SWAP_HISTORY = 32
"""Policy swaps remembered so an idle bucket converts its debt at each swap instant."""
ALL = 1 << 30
"""More tokens than any step asks for: what `available` answers for the unlimited."""
STALE = -1
"""A bucket generation no table has: its limit is re-resolved at its next touch."""


class Account(Protocol):
    """Credit a shared budget leased for one user on this engine
    (outrate.budget.shared.credit.Credit). Credit held is `granted - spent -
    released`; while the lender says takes spend it, a take must fit in it as
    well as in the local GCRA. The table writes `spent` only (the scheduler's
    thread); the lender documents who writes the rest."""

    granted: int
    spent: int
    released: int
    leased: bool
    """The lease thread still holds the bucket: cleanup must keep it."""


class LimitSource(Protocol):
    """What the limiter needs of a policy (outrate.policy.compiler.CompiledPolicy is one):
    the limiter sits below the compiler and never imports it."""

    def limit_for(self, user_id: str) -> Limit: ...


class Bucket:
    """A user's state: the TAT, plus what is needed to keep it valid.

    `limit` and `gen` let a policy swap be O(1): a bucket re-resolves its limit
    (carrying its debt in tokens) the next time it is touched. `pins` counts
    live requests holding this bucket, so cleanup never splits a user's state.
    `credit` is its account with a shared budget (None in memory alone).
    """

    __slots__ = ("gen", "limit", "tat", "credit", "key", "pins", "etat")  # the take's first

    def __init__(self, key: str, limit: Limit, gen: int) -> None:
        self.key = key
        self.tat = 0
        self.etat = 0
        """The excess bucket's TAT (borrowed tokens: `limit.excess`), in its units."""
        self.limit = limit
        self.gen = gen
        self.credit: Account | None = None
        self.pins = 0


class Lender(Protocol):
    """What a budget shared with other engines adds to the table
    (outrate.budget.shared.credit.SharedBudget). Called on the scheduler's
    thread only, and never per token."""

    def open(self, b: Bucket) -> Account:
        """The account of a bucket just created."""

    def local(self, b: Bucket, lim: Limit) -> Limit:
        """The limit the table enforces for `b`'s user where the policy says `lim`."""

    def boundary(self, table: Limiter) -> bool:
        """Between steps: apply what the lease thread published (through
        `table.invalidate` and `table.stale`). Returns whether takes spend
        their accounts until the next boundary."""

    def pinned(self, b: Bucket) -> None:
        """`b`'s first live request arrived."""

    def unpinned(self, b: Bucket) -> None:
        """`b`'s last live request left."""

    def credit_due(self, now: int) -> int:
        """When credit is next expected for a bucket that holds none."""


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


def _due(tat: int, ahead: int, scale: int, now: int) -> int:
    """Earliest time (ns), `now` at the soonest, at which a TAT is at most
    `ahead` in front of the clock (`gcra()`'s test solved for the time)."""
    t = _ceil_div(tat - ahead, scale)
    return t if t > now else now


def _carried(tat: int, old: Limit | None, new: Limit | None, at: int) -> int:
    """A TAT under `old` as one under `new`: the debt at `at`, in tokens."""
    if old is not None and new is not None:
        if new.scale == old.scale and new.interval == old.interval:
            return tat  # same units: the TAT stands as it is
    if old is None or new is None or not old.scale or not new.scale:
        return 0
    debt = tat - at * old.scale
    return at * new.scale + _ceil_div(debt * new.interval, old.interval) if debt > 0 else 0


class Limiter:
    """The per-user table. One per engine; only the scheduler thread mutates it."""

    def __init__(
        self,
        policy: LimitSource,
        clock: Callable[[], int] = time.monotonic_ns,
        lender: Lender | None = None,
    ) -> None:
        self._policy = policy
        self._gen = 0
        self._swaps: deque[tuple[int, int | None, LimitSource]] = deque(maxlen=SWAP_HISTORY)
        self._buckets: dict[str, Bucket] = {}
        self._sweep: deque[str] = deque()
        self._pinned = 0  # buckets with pins (cleanup never drops them)
        self.clock = clock
        self.lender = lender
        self._spend = False
        """Takes spend their bucket's account: the lender's word at the last boundary."""

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

    def invalidate(self) -> None:
        """Every bucket re-resolves its limit at its next touch, keeping its
        debt in tokens (a shared budget's mode changed)."""
        self._gen += 1

    def stale(self, b: Bucket) -> None:
        """`b` re-resolves its limit at its next touch (its share changed)."""
        if b.gen == self._gen:
            b.gen = STALE  # older than every swap remembered: converts at the touch

    def _local(self, b: Bucket, lim: Limit) -> Limit:
        return lim if self.lender is None else self.lender.local(b, lim)

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
        """Carry `b`'s debt as it stood at `at` over to `new`, in tokens (the
        excess bucket's too)."""
        old = b.limit
        b.tat = _carried(b.tat, old, new, at)
        if old.excess is not None or new.excess is not None:
            b.etat = _carried(b.etat, old.excess, new.excess, at)
        b.limit = new

    # -- the table ---------------------------------------------------------

    def bucket(self, user: str) -> Bucket:
        """The user's bucket, created on first use."""
        b = self._buckets.get(user)
        if b is None:
            lim = self._policy.limit_for(user)
            b = Bucket(user, lim, self._gen)
            lender = self.lender
            if lender is not None:
                b.credit = lender.open(b)
                b.limit = lender.local(b, lim)
            self._buckets[user] = b
            self._sweep.append(user)
        return b

    def buckets(self) -> list[Bucket]:
        """Every bucket, as a list taken at once (a shared budget's lease
        thread reads it too: copying a dict's values does not let the
        scheduler's thread in between)."""
        return list(self._buckets.values())

    def pin(self, user: str) -> Bucket:
        """Take a reference a request can keep; cleanup will not drop it.
        A step boundary for a lender: requests arrive between steps."""
        lender = self.lender
        if lender is not None:
            self._spend = lender.boundary(self)
        b = self.bucket(user)
        b.pins += 1
        if b.pins == 1:
            self._pinned += 1
            if lender is not None:
                lender.pinned(b)
        return b

    def unpin(self, b: Bucket) -> None:
        b.pins -= 1
        if not b.pins:
            self._pinned -= 1
            if self.lender is not None:
                self.lender.unpinned(b)

    def limit_of(self, b: Bucket, now: int) -> Limit:
        if b.gen != self._gen:
            self._refresh(b, now)
        return b.limit

    # -- hot path ----------------------------------------------------------

    def take_upto(self, b: Bucket, now: int, n: int) -> int:
        """Take up to `n` tokens from `b` at `now` (ns): as many as `n`
        `take`s at `now` back to back would, in one call. Returns how many (0
        when even one would not conform). O(1), no I/O: the scheduler takes a
        user's tokens for a step with it and gives back what it did not use."""
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        s = lim.scale
        if not s:
            return n  # unlimited: no state, no credit
        a = b.credit if self._spend else None
        if a is not None:  # leased credit bounds the take too
            held = a.granted - a.spent - a.released
            if held < n:
                n = held
        k, b.tat = gcra(b.tat, now * s, lim.interval, lim.tolerance, n)
        if a is not None:
            a.spent += k
        return k

    def take(self, b: Bucket, now: int) -> bool:
        """Take one token from `b` at `now` if it conforms."""
        return self.take_upto(b, now, 1) == 1

    def give_back(self, b: Bucket, now: int, n: int = 1) -> None:
        """Undo `n` tokens of takes that succeeded (the refund point; a step's
        unused tokens)."""
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        b.tat -= n * lim.interval
        a = b.credit if self._spend else None
        if a is not None and lim.scale:
            a.spent -= n

    def ready_at(self, b: Bucket, now: int) -> int:
        """Earliest time (ns) at which a take from `b` succeeds; `now` if one
        does now. (`gcra()`'s test solved for the time: the TAT at most the
        tolerance ahead; with a shared budget, credit held too.)"""
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        if not lim.scale:
            return now
        t = _due(b.tat, lim.tolerance, lim.scale, now)
        a, lender = b.credit, self.lender
        if self._spend and a is not None and lender is not None:
            if a.granted - a.spent - a.released <= 0:
                t = max(t, lender.credit_due(now))
        return t

    def full_at(self, b: Bucket, now: int) -> int:
        """Earliest time (ns) at which `b` holds its whole burst again (its TAT
        no later than that time); `now` if it does now. What `reset` means in
        rate-limit headers (docs/client-contract.md)."""
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        return _due(b.tat, 0, lim.scale, now) if lim.scale else now

    def waits_for_credit(self, b: Bucket, now: int) -> bool:
        """A take at `now` fails only for want of credit: the local GCRA
        conforms, but a shared budget's account holds none (it is on its
        way: a user new to this process). False without a lender."""
        a = b.credit if self._spend else None
        if a is None or a.granted - a.spent - a.released > 0:
            return False
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        return not lim.scale or b.tat - now * lim.scale <= lim.tolerance

    def available(self, b: Bucket, now: int) -> int:
        """Tokens `b` could take at `now` back to back (its remaining burst).

        Unlimited buckets answer a number larger than any step can use.
        """
        if b.gen != self._gen:
            self._refresh(b, now)
        lim = b.limit
        if not lim.scale:
            return ALL
        k = gcra(b.tat, now * lim.scale, lim.interval, lim.tolerance, ALL)[0]
        a = b.credit if self._spend else None
        if a is not None:
            held = a.granted - a.spent - a.released
            return k if k < held else max(held, 0)
        return k

    # -- borrowing (work-conserving limits: Limit.peak) ----------------------

    def _excess(self, b: Bucket, now: int) -> Limit | None:
        """The limit of `b`'s excess bucket (None: its rule has no peak)."""
        if b.gen != self._gen:
            self._refresh(b, now)
        return b.limit.excess

    def can_borrow(self, b: Bucket, now: int) -> bool:
        """Whether `b`'s user may borrow a token at `now`: its limit has a peak
        and the excess bucket has a token. (The scheduler decides whether there
        is spare capacity to borrow from; this only says the peak allows it.)"""
        ex = self._excess(b, now)
        return ex is not None and (not ex.scale or b.etat - now * ex.scale <= ex.tolerance)

    def borrowable(self, b: Bucket, now: int) -> int:
        """Borrowed tokens `b`'s user could take at `now` back to back (its
        excess bucket's remaining burst; 0 without a peak)."""
        ex = self._excess(b, now)
        if ex is None:
            return 0
        if not ex.scale:
            return ALL
        return gcra(b.etat, now * ex.scale, ex.interval, ex.tolerance, ALL)[0]

    def borrow_ready_at(self, b: Bucket, now: int) -> int | None:
        """Earliest time (ns) at which a borrow from `b`'s excess bucket
        succeeds; `now` if one does now; None without a peak. (`ready_at`
        for the excess bucket: whether there is spare capacity to borrow is
        the scheduler's question.)"""
        ex = self._excess(b, now)
        if ex is None:
            return None
        return _due(b.etat, ex.tolerance, ex.scale, now) if ex.scale else now

    def borrow(self, b: Bucket, now: int) -> bool:
        """Take one borrowed token from the excess bucket alone: the committed
        bucket is not touched, so borrowing leaves it no debt."""
        return self.borrow_upto(b, now, 1) == 1

    def borrow_upto(self, b: Bucket, now: int, n: int) -> int:
        """Take up to `n` borrowed tokens from the excess bucket alone (as
        `take_upto` does from the committed one); how many. 0 without a peak."""
        ex = self._excess(b, now)
        if ex is None:
            return 0
        if not ex.scale:
            return n  # peak: unlimited
        k, b.etat = gcra(b.etat, now * ex.scale, ex.interval, ex.tolerance, n)
        return k

    def give_back_borrowed(self, b: Bucket, now: int, n: int = 1) -> None:
        """Undo `n` borrowed tokens (the refund point)."""
        ex = self._excess(b, now)
        if ex is not None and ex.scale:
            b.etat -= n * ex.interval

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
        if b is None:  # a fresh user: its whole burst
            return Stats(lim, gcra(0, 0, lim.interval, lim.tolerance, ALL)[0], 0, now)
        remaining = self.available(b, now)
        ready = self.ready_at(b, now)
        return Stats(lim, remaining, ready - now, ready)

    # -- housekeeping ------------------------------------------------------

    def cleanup(self, now: int | None = None, budget: int = 64) -> int:
        """Drop up to `budget` examined idle users; bounded work per call.
        The end of every step: a lender's boundary too.

        A user whose TAT is not ahead of `now` is indistinguishable from a user
        never seen, so dropping it changes no decision. Pinned buckets stay,
        and so do those a shared budget's lease thread still holds.
        """
        if self.lender is not None:
            self._spend = self.lender.boundary(self)
        sweep, buckets = self._sweep, self._buckets
        if len(buckets) == self._pinned:
            return 0  # every user has live requests: nobody to forget (each step's case)
        now = self._now(now)
        removed = 0
        for _ in range(min(budget, len(sweep))):
            key = sweep.popleft()
            b = buckets[key]
            a = b.credit
            ex = b.limit.excess
            idle = b.tat <= now * b.limit.scale and (ex is None or b.etat <= now * ex.scale)
            if b.pins == 0 and idle and not (a and a.leased):
                del buckets[key]
                removed += 1
            else:
                sweep.append(key)
        return removed

    def __len__(self) -> int:
        return len(self._buckets)

    def __contains__(self, user: object) -> bool:
        return user in self._buckets

    def export(self, now: int | None = None) -> Iterator[tuple[str, Stats]]:
        """Every known user's stats: the hook for metrics and tools."""
        now = self._now(now)
        for key in list(self._buckets):
            yield key, self.stats(key, now)
