"""Whom the lease thread calls in a round, and for how long a slice lasts: `Turns`.

The cap, in one sentence: a round sends at most `cap` lease calls
(`ROUND_CALLS`), users new to a lease first and then the others in turn from
where the last round stopped, so with U users holding a lease each one is
visited at least once every `ceil(U / cap)` rounds, and the horizon of its
slice is that many lease periods plus a round trip (`LeaseRunner.horizon_us`).

The cap is fixed; only the horizon follows what was measured (the period
between rounds and the last round trip), so a slow store or many users cost
slack in the bound (S grows with H), not rounds nor throughput. Nothing here
feeds back into the cap. Past ~50 x `ROUND_CALLS` users with a lease
(~51,000 at 20 ms rounds) a turn takes longer than the longest horizon (1 s,
`MAX_HORIZON_US`) and users start to lose rate.

A user is called when its credit ran below its slice, its demand changed or
its registration is due, its state was lost in Redis, or it has credit to
hand back; a user whose last
request left is deregistered, and dropped once it holds nothing. Runs on the
lease thread only; it writes what the module docstring of
outrate.budget.shared.credit gives the lease thread.
"""

from __future__ import annotations

import logging
from collections import deque

from outrate.budget.limiter import Limit, LimitSource
from outrate.budget.shared.credit import Credit, SharedBudget, credit_of
from outrate.budget.shared.lease import MAX_DEMAND, MAX_TOKENS, OUTPUT, LeaseCall, Units

ROUND_CALLS = 1024
"""Most lease calls one round sends. A call costs Redis and this thread
~14 us on a busy 2-core machine (bench_store, 10,000 users), so a full round
takes ~14 ms of the 20 ms lease interval: rounds stay one per interval, and
10,000 users are each visited every 10 rounds (H ~200 ms)."""
DEMAND_REFRESH_NS = 500_000_000
"""An engine's demand for a user expires in Redis unless renewed this often."""


class Turns:
    """The users with a lease here of one kind of budget (`kind`: output or
    prompt tokens, outrate.budget.shared.lease), and the order they are called in."""

    def __init__(
        self,
        budget: SharedBudget,
        log: logging.Logger,
        cap: int = ROUND_CALLS,
        kind: str = OUTPUT,
    ) -> None:
        if cap < 1:
            raise ValueError(f"a round's cap must be >= 1 call, got {cap}")
        self.budget = budget
        self.kind = kind
        self.log = log
        self.cap = cap
        self.active: dict[Credit, None] = {}
        """Users with a lease here, visited in turn through `_ring`, new ones
        (`_fresh`) first."""
        self._ring: deque[Credit] = deque()
        self._fresh: deque[Credit] = deque()
        self.max_horizon_us = 0
        """The longest horizon sent (the bound's H; tests and the benchmark)."""
        self._units: dict[Limit, Units | None] = {}
        self._units_by_id: dict[int, tuple[Limit, Units | None]] = {}

    def __len__(self) -> int:
        return len(self.active)

    def rounds(self) -> int:
        """Rounds a full turn of the users takes: ceil(users / cap)."""
        return max(1, -(-len(self.active) // self.cap))

    def drain(self) -> None:
        """Take in the users whose first request arrived since the last round."""
        arrivals = self.budget.arrivals
        while arrivals:
            self.activate(credit_of(arrivals.popleft()))

    def activate(self, c: Credit) -> None:
        if c not in self.active:
            c.leased = True
            self.active[c] = None
            self._fresh.append(c)

    def drop(self, c: Credit) -> None:
        c.leased = False
        self.active.pop(c, None)

    def units_of(self, lim: Limit) -> Units | None:
        """The limit in the store's integers (None: unlimited, or not shareable)."""
        # By identity first: a Limit's hash (its Fractions) costs ~2 us, and
        # a round asks once per user. The entry keeps `lim` alive, so its id
        # is not reused while cached.
        hit = self._units_by_id.get(id(lim))
        if hit is not None and hit[0] is lim:
            return hit[1]
        if lim not in self._units:
            try:
                self._units[lim] = Units.of(lim) if lim.rate is not None else None
            except ValueError as e:
                self.log.warning("outrate: %s: kept local, not shared: %s", lim.rule, e)
                self._units[lim] = None
        if len(self._units_by_id) > 10_000:
            self._units_by_id.clear()
        self._units_by_id[id(lim)] = (lim, self._units[lim])
        return self._units[lim]

    def plan(
        self,
        policy: LimitSource,
        now: int,
        horizon_us: int,
        debts: dict[Credit, int] | None = None,
    ) -> list[tuple[Credit, LeaseCall]]:
        """The calls of one round: newcomers first, then the others in turn
        from where the last round stopped, until `cap` calls (every user, when
        reporting `debts` after an outage)."""
        cap = self.cap if debts is None else len(self.active) + 1
        out: list[tuple[Credit, LeaseCall]] = []
        fresh, ring = self._fresh, self._ring
        turns = len(ring)
        while fresh and len(out) < cap:
            c = fresh.popleft()
            if self._visit(c, policy.limit_for(c.bucket.key), now, horizon_us, debts, out):
                ring.append(c)
        while turns and len(out) < cap:
            turns -= 1
            c = ring.popleft()
            if self._visit(c, policy.limit_for(c.bucket.key), now, horizon_us, debts, out):
                ring.append(c)
        return out

    def _visit(
        self,
        c: Credit,
        lim: Limit,
        now: int,
        horizon_us: int,
        debts: dict[Credit, int] | None,
        out: list[tuple[Credit, LeaseCall]],
    ) -> bool:
        """Add `c`'s call to `out` if it needs one. False: `c` left the lease."""
        units = self.units_of(lim)
        key, pins = c.bucket.key, c.bucket.pins
        refund = c.released - c.sent
        if units is None:  # unlimited (or not shareable): nothing to lease
            if pins == 0 or not c.reg:
                self.drop(c)
                return False
            pins = 0
        held = c.granted - c.spent - c.released
        debt = debts.get(c, 0) if debts else 0
        lost = c.lost
        if pins == 0:
            if not refund and not c.reg and not debt and not lost:
                if held > 0:
                    self.budget.settle.append(c.bucket)  # released at the next step
                else:
                    self.drop(c)
                    return False
                return True
            if units is None:
                units = Units(1, 1, 0)  # only deregisters: no token moves
            call = LeaseCall(key, units, 0, 0, 0, refund, 0, debt, True, lost, self.kind)
            out.append((c, call))
            return True
        d = min(pins, MAX_DEMAND)
        assert units is not None  # (pins > 0: a limited user)
        register = not c.reg or d != c.demand or now - c.reg_at > DEMAND_REFRESH_NS
        # Low: below the slice, or (for users far from their rate) below
        # twice what they spent since the last visit.
        spent = c.spent
        low = held < max(1, min(c.fair, 2 * (spent - c.seen) + 1))
        c.seen = spent
        if low or refund or debt or register or lost:
            call = LeaseCall(
                key,
                units,
                d,
                max(held, 0),
                MAX_TOKENS,
                refund,
                horizon_us,
                debt,
                register,
                lost,
                self.kind,
            )
            out.append((c, call))
            if horizon_us > self.max_horizon_us:
                self.max_horizon_us = horizon_us
        return True
