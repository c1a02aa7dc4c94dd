"""A budget shared by several engines, the scheduler's side: `SharedBudget`.

The table stays `Limiter` (outrate.budget.limiter); a `SharedBudget` is its
`Lender`. It gives each bucket a `Credit` (tokens this engine leased for the
user from the global GCRA in Redis) and tells the table which limit to pace
the user at here. A token is taken when the user's local GCRA conforms (as on
one engine) *and* the engine holds credit for the user. `LeaseRunner`
(outrate.budget.shared.runner), a thread in the engine core, keeps that
credit topped up and returns what users who left no longer need.

The two threads never lock. What crosses between them:

- **One mode record.** The lease thread publishes a `Mode` (shared or in the
  fallback, just back from it or not, N of the fallback) by assigning
  `SharedBudget.mode`, one immutable record. The scheduler's thread reads it
  at step boundaries (the table's `pin` and `cleanup`) and applies it there:
  it never sees half a switch, and a mode holds for a whole step.
- **One writer per `Credit` field.** The lease thread writes `granted`,
  `sent`, `share` and its bookkeeping (`fair`, `demand`, `seen`, `reg`,
  `reg_at`, `leased`, `lost`); the scheduler writes `spent` (takes, net of give
  backs) and `released` (credit handed back). Credit held is `granted -
  spent - released`: each thread reads the other's fields, never writes them.
- **Queues of buckets** (deques, appended by one thread, popped by the
  other): `arrivals` (a user's first request: lease it now), `settle`
  (credit granted after the user's last request left: release it) and
  `reshare` (the user's share here changed: re-resolve its local limit).
  `next_credit_ns` is a hint for `ready_at` (lease thread).

The local limit is the policy's rate times this engine's share of the
user's demand (its live requests over every engine's, as Redis last
reported), so engines pace a user fairly. Without the store the scheduler
keeps going on local GCRA alone, at `rate / N` per engine (N: engines
when the store went away, or the engines expected when it was never
reached), at most its last share (`FALLBACKS`: `local` for as long as the
outage lasts, `pause` for the hold and then limited users wait), or at the
full rate (`full`); just back from the fallback it stays within `rate / N`
a while (`Mode.grace`); while engines gone without leaving may still be in
their fallback, the live ones leave them their part (`Mode.scale`).

The bound (docs/several-engines.md): in any window W a user's tokens summed
over all engines stay within `(W + burst) * rate + 1 + S`, where S is the
credit outstanding at the window's start plus what Redis grants ahead of
now: S = rate * (H + max(0, H - burst)) + N for N engines serving the user,
H the lease horizon (outrate.budget.shared.runner).
"""

from __future__ import annotations

import threading
from collections import deque
from fractions import Fraction
from typing import NamedTuple, cast

from outrate.budget.limiter import NS_PER_S, Account, Bucket, Limit, Limiter

LEASE_INTERVAL_S = 0.02
"""One round trip per 20 ms: a fifth of the default 100 ms burst, so four
engines' slices (rate * 20 ms in all) stay well inside one burst, and ~50
round trips/s per engine cost Redis nothing. A user's first token waits at
most half an interval (new users wake the lease thread early, at most twice
per interval) plus one round trip."""
FALLBACKS = ("local", "pause", "full")
"""What an engine does while its store is unreachable (`--outrate-store-fallback`):

- `local` (the default): `rate/N` on each engine, at most each user's last
  share, for as long as the outage lasts; an engine that never reached the
  store uses the engines expected (`--outrate-store-engines`, else the
  data-parallel size, else 1). Nobody is paused.
- `pause`: the same for the hold (`--outrate-store-hold-s`), then limited
  users wait for the store; an engine that never reached it makes them wait
  at once. The tightest bound, at the cost of availability.
- `full`: each engine enforces the full rate: up to N x in total.
"""
DEFAULT_FALLBACK = "local"
DEPRECATED_FALLBACKS = {"share": "pause"}
"""Old names still accepted, with a warning: `share` was today's `pause`."""
FULL = Fraction(1)


def fallback_named(name: str | None) -> tuple[str, str | None]:
    """(the fallback mode `name` means, a deprecation note or None). Raises
    ValueError for a name that is none of `FALLBACKS` (or an old name of one)."""
    if name is None:
        return DEFAULT_FALLBACK, None
    if name in DEPRECATED_FALLBACKS:
        new = DEPRECATED_FALLBACKS[name]
        return new, (
            f"--outrate-store-fallback {name} is deprecated: it is now called {new!r} "
            f"(limited users wait for the store once the hold is over); the default, "
            f"{DEFAULT_FALLBACK!r}, keeps serving them at rate/N for the whole outage"
        )
    if name not in FALLBACKS:
        raise ValueError(f"must be one of {', '.join(FALLBACKS)}, got {name!r}")
    return name, None


class Mode(NamedTuple):
    """What the lease thread publishes, in one assignment."""

    shared: bool = False
    """Takes spend leased credit; False: the fallback, local GCRA alone. An
    engine that waits for its store (it never reached it, or its fallback
    ran out: outrate.budget.shared.runner) is shared with no credit coming:
    its limited users wait, they are not cut (fallback `pause` only)."""
    grace: bool = False
    """Just back from the fallback: stay within rate/n until the other engines are."""
    n: int = 1
    """Engines the fallback (and the grace) divides the rate by."""
    scale: Fraction = Fraction(1)
    """Shared: what the live engines keep of each rate while engines gone
    without leaving may still spend their fallback (each its 1/n of it)."""


class Credit:
    """One user's lease on this engine (`Account` to the table). Writers per
    field: see the module docstring."""

    __slots__ = (
        "bucket",
        "granted",
        "spent",
        "released",
        "sent",
        "share",
        "fair",
        "demand",
        "seen",
        "reg",
        "reg_at",
        "leased",
        "lost",
    )

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.granted = 0  # lease thread: tokens Redis granted to this engine
        self.spent = 0  # scheduler: tokens taken (net of give_back)
        self.released = 0  # scheduler: credit handed back
        self.sent = 0  # lease thread: released credit returned to Redis
        self.share = FULL  # lease thread: this engine's share of the user's demand
        self.fair = 0  # lease thread: the last fair slice Redis computed
        self.demand = 0  # lease thread: the demand last reported
        self.seen = 0  # lease thread: `spent` at its last visit
        self.reg = False  # lease thread: demand registered in Redis
        self.reg_at = 0  # lease thread: when it last wrote its demand
        self.leased = False  # lease thread: in its active set (the table keeps the bucket)
        self.lost = False  # lease thread: its state was lost in Redis, not yet answered

    @property
    def held(self) -> int:
        """Credit held: what takes may still spend."""
        return self.granted - self.spent - self.released

    def release(self) -> None:
        """Scheduler: hand back all credit held (the lease thread returns it)."""
        c = self.granted - self.spent - self.released
        if c > 0:
            self.released += c


def credit_of(b: Bucket) -> Credit:
    """`b`'s Credit: every bucket of a table lent by a SharedBudget has one
    (`SharedBudget.open`)."""
    return cast(Credit, b.credit)


class SharedBudget:
    """The `Lender` of a table whose budgets are shared through Redis."""

    def __init__(
        self,
        fallback: str = DEFAULT_FALLBACK,
        engines_hint: int = 1,
        interval_s: float = LEASE_INTERVAL_S,
    ) -> None:
        self.fallback = fallback_named(fallback)[0]
        self.mode = Mode(n=max(1, engines_hint))
        """Published by the lease thread (one assignment of a new record)."""
        self.applied = self.mode
        """The mode in force (scheduler's thread, set at step boundaries)."""
        self.arrivals: deque[Bucket] = deque()
        self.settle: deque[Bucket] = deque()
        self.reshare: deque[Bucket] = deque()
        self.kick = threading.Event()
        """Set on an arrival: wakes the lease thread early."""
        self.interval_ns = int(interval_s * NS_PER_S)
        self.next_credit_ns = 0
        """When the next lease round is expected to have answered (lease thread)."""
        self._scaled: dict[tuple[Limit, Fraction], Limit] = {}

    # -- the Lender's verbs (scheduler's thread) --------------------------------

    def open(self, b: Bucket) -> Account:
        return Credit(b)

    def local(self, b: Bucket, lim: Limit) -> Limit:
        """The policy's limit times this engine's share of the user's demand
        (shared), or times 1/N (fallbacks `local` and `pause`, and the grace
        after them).
        Pacing each engine at its share is what makes engines share fairly:
        without it, the engine whose lease calls happen to land first after
        each token conforms in Redis would take them all."""
        if lim.rate is None:
            return lim
        mode = self.applied
        share = credit_of(b).share
        if self.fallback != "full":
            if not mode.shared:
                # Alone: at most 1/N, and at most the last share Redis gave
                # (another engine may be spending the rest of it).
                share = min(share, Fraction(1, mode.n))
            else:
                if mode.grace:
                    # Just back from the fallback: other engines may still be
                    # in theirs (they retry once a second), spending rate/N
                    # each without Redis knowing. Until they are back, stay
                    # within rate/N too.
                    share = min(share, Fraction(1, mode.n))
                share *= mode.scale  # what engines cut off may still spend
        elif not mode.shared:
            return lim
        if share >= 1:
            return lim
        scaled = self._scaled.get((lim, share))
        if scaled is None:
            if len(self._scaled) > 10_000:
                self._scaled.clear()
            scaled = self._scaled[(lim, share)] = lim.scaled(share)
        return scaled

    def boundary(self, table: Limiter) -> bool:
        """Apply the published mode; release credit granted to users who
        left; re-resolve the limits whose share changed. Leaving shared mode
        drops the credit held (leased before the outage: dropping it never
        grants anything); any switch makes every bucket re-resolve its
        limit, keeping its debt in tokens."""
        mode = self.mode
        if mode is not self.applied:
            if mode != self.applied:
                if self.applied.shared and not mode.shared:
                    for b in table.buckets():
                        c = credit_of(b)
                        c.spent = c.granted - c.released
                table.invalidate()
            self.applied = mode
        settle, reshare = self.settle, self.reshare
        while settle:
            b = settle.popleft()
            if b.pins == 0 and mode.shared:
                credit_of(b).release()
        while reshare:
            table.stale(reshare.popleft())
        return mode.shared

    def pinned(self, b: Bucket) -> None:
        self.arrivals.append(b)
        self.kick.set()

    def unpinned(self, b: Bucket) -> None:
        if self.applied.shared:
            credit_of(b).release()

    def credit_due(self, now: int) -> int:
        due = self.next_credit_ns
        return due if due > now else now + self.interval_ns // 4
