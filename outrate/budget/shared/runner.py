"""The lease thread of a shared budget (`--outrate-store`): `LeaseRunner`.

One per engine core. Every lease interval it sends one pipelined round trip
to Redis (outrate.budget.shared.lease) with the calls `Turns` plans
(outrate.budget.shared.turns: at most `ROUND_CALLS` of them, newcomers
first, then the others in turn), and every second a heartbeat with this
engine's id and policy sha256. The slice each call asks for lasts the
horizon H: until the user's next turn, that many measured periods, plus a
round trip.

It owns the faults, and says so by publishing one `Mode` record
(outrate.budget.shared.credit), which the scheduler applies at its next step:
two failed round trips in a row switch to the fallback; the first answer
after that reports each user's local debt so nobody gets a burst, and
starts a grace at rate/N until the other engines are back. Each switch is
logged once and counted in `StoreMetrics`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from fractions import Fraction

from outrate.budget.limiter import NS_PER_S, Limiter
from outrate.budget.shared.credit import (
    LEASE_INTERVAL_S,
    Credit,
    Mode,
    SharedBudget,
    credit_of,
)
from outrate.budget.shared.lease import MAX_HORIZON_US, LeaseCall, RedisLink
from outrate.budget.shared.metrics import StoreMetrics
from outrate.budget.shared.turns import ROUND_CALLS, Turns

HEARTBEAT_S = 1.0
ENGINE_TTL_S = 3.0
"""An engine that has not heartbeaten for 3 s is no longer counted."""
DEMAND_TTL_S = 2.0
"""An engine's demand for a user expires unless renewed (every 0.5 s)."""
RETRY_S = 1.0
"""While the store is down, how often the lease thread tries again."""
TIMEOUT_S = 0.5
"""A round trip slower than this fails."""
GRACE_NS = int((RETRY_S + HEARTBEAT_S + ENGINE_TTL_S) * NS_PER_S)
"""After the store is back, each engine stays within rate/N until the
heartbeats show every engine back, at most this long (the others retry once
a second; a dead one's heartbeat expires)."""
DOWN_AFTER = 2
"""Consecutive failed round trips before an engine falls back: one slow
answer on a loaded machine (a starved process, not a slow store) is
retried at the next round instead of switching modes."""


def engine_id() -> str:
    """Unique per engine-core process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class LeaseRunner:
    """The lease thread: one pipelined round trip per interval, off the hot path.

    `table` is the scheduler's `Limiter`, lent by `budget`: the runner reads
    its policy, clock and buckets (`buckets()`), and talks to the scheduler
    through `budget` only."""

    def __init__(
        self,
        table: Limiter,
        budget: SharedBudget,
        link: RedisLink,
        policy_sha: Callable[[], str],
        metrics: StoreMetrics | None = None,
        engine: str | None = None,
        logger: logging.Logger | None = None,
        interval_s: float = LEASE_INTERVAL_S,
        retry_s: float = RETRY_S,
        heartbeat_s: float = HEARTBEAT_S,
        cap: int = ROUND_CALLS,
    ) -> None:
        if table.lender is not budget:
            raise ValueError("the table must be lent by this budget (Limiter(lender=budget))")
        self.table = table
        self.budget = budget
        self.link = link
        self.policy_sha = policy_sha
        self.metrics = metrics or StoreMetrics()
        self.engine = engine or engine_id()
        self.log = logger or logging.getLogger("vllm.outrate")
        self.turns = Turns(budget, self.log, cap)
        self.interval_ns = int(interval_s * NS_PER_S)
        self.retry_s = retry_s
        self.heartbeat_ns = int(heartbeat_s * NS_PER_S)
        self.engines = budget.mode.n
        """Live engines by the last heartbeat (the hint until one answered)."""
        self.up: bool | None = None  # None: not tried yet
        self._fails = 0  # consecutive failed round trips
        self._grace_end = 0
        self._ever_up = False
        self.period_ns = self.interval_ns
        """Time between the starts of the last two rounds."""
        self.avg_period_ns = self.interval_ns
        """Moving average of the period (1/8 weight to the newest)."""
        self.last_rtt_ns = 0
        self.late_ns = 0
        """Time this thread started rounds late: the sum over rounds of what
        the period exceeded two intervals by (a starved process, a slow store).
        Counted only while users hold leases here: their credit runs dry while
        it is late, so tests discount it from the rate they expect."""
        self._last_beat = 0
        self._last_start = 0
        self._mismatch: frozenset[str] = frozenset()
        self._stopping = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outrate-lease", daemon=True)

    @property
    def max_horizon_us(self) -> int:
        """The longest horizon sent (the bound's H)."""
        return self.turns.max_horizon_us

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Try the store once right here (at most 2 x `TIMEOUT_S`; unless it
        answered already), so requests arriving right after start are already
        shared, then keep leasing in the thread. An unreachable store is
        logged, and retried there."""
        if not self.up:
            self.connect()
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, then hand back every credit held and leave."""
        self._stopping = True
        self._stop.set()
        self.budget.kick.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        if self.up:
            try:
                self._leave()
            except Exception as e:  # best effort: leases expire in Redis anyway
                self.log.info("outrate: could not hand leases back on shutdown: %s", e)
        self.link.close()

    def _run(self) -> None:
        kick = self.budget.kick
        next_round = time.monotonic_ns()
        while not self._stopping:
            if not self.up:
                if self._stop.wait(self.retry_s):
                    return
                self.turns.drain()
                self.connect()
                next_round = time.monotonic_ns()
                continue
            delay = next_round - time.monotonic_ns()
            if delay > 0:
                if kick.wait(delay / NS_PER_S):
                    kick.clear()
                    if self._stopping:
                        return
                    # A new user: go early, but never twice within half an interval.
                    early = self._last_start + self.interval_ns // 2 - time.monotonic_ns()
                    if early > 0:
                        time.sleep(early / NS_PER_S)
                if self._stopping:
                    return
            self.round()
            next_round = self._last_start + self.interval_ns

    # -- one round -----------------------------------------------------------------

    def horizon_us(self) -> int:
        """The lease horizon H: how long one slice must last. The engine
        reports its credit when a round is planned and the grant lands one
        round trip later; the user's next grant lands when its next turn
        comes, `Turns.rounds()` periods later. So H is the period, plus the
        periods after it at their moving average (one late round, a burst
        of new users, is not multiplied by the number of rounds), plus the
        last round trip: at least the lease interval, at most 1 s. With a
        fast store and few users that is ~20 ms; slow rounds or many users
        make it grow, and the script grants what conforms within H."""
        cycle = self.period_ns + (self.turns.rounds() - 1) * self.avg_period_ns
        h = max(self.interval_ns, cycle + self.last_rtt_ns)
        return min(h // 1000, MAX_HORIZON_US)

    def round(self, debts: dict[Credit, int] | None = None) -> bool:
        """One round trip. Returns False (and counts a failure) on error."""
        start = time.monotonic_ns()
        if self._last_start:
            self.period_ns = start - self._last_start
            self.avg_period_ns += (self.period_ns - self.avg_period_ns) // 8
            if self.period_ns > 2 * self.interval_ns and self.turns.active:
                self.late_ns += self.period_ns - 2 * self.interval_ns
        self._last_start = start
        self.turns.drain()
        plan = self.turns.plan(self.table.policy, start, self.horizon_us(), debts)
        budget = self.budget
        beat = None
        if start - self._last_beat >= self.heartbeat_ns:
            beat = (self.policy_sha(), int(ENGINE_TTL_S * 1_000_000))
        if not plan and beat is None:
            budget.next_credit_ns = start + self.interval_ns
            return True
        try:
            grants, engines = self.link.round_trip(
                self.engine, [c for _, c in plan], int(DEMAND_TTL_S * 1_000_000), beat
            )
        except Exception as e:
            self._down(e)
            return False
        end = time.monotonic_ns()
        self._fails = 0
        m = self.metrics
        m.round_trips += 1
        m.calls += len(plan)
        m.lease.observe(end - start)
        self.last_rtt_ns = end - start
        budget.next_credit_ns = start + self.interval_ns + self.last_rtt_ns
        for (c, call), g in zip(plan, grants, strict=True):
            if g.granted:
                c.granted += g.granted
                if c.bucket.pins == 0:
                    budget.settle.append(c.bucket)
            c.sent += call.refund
            c.fair = g.fair
            if call.demand and g.demand:
                share = Fraction(call.demand, g.demand)
                if share != c.share:
                    c.share = share
                    budget.reshare.append(c.bucket)  # the scheduler re-resolves its limit
            c.demand = call.demand
            c.reg = call.demand > 0
            if call.register:
                c.reg_at = start
        if engines is not None:
            self._last_beat = start
            self._engines(engines)
        return True

    def _engines(self, engines: list[tuple[str, str]]) -> None:
        n = max(1, len(engines))
        mode = self.budget.mode
        if mode.grace and (n >= mode.n or time.monotonic_ns() > self._grace_end):
            self.budget.mode = mode._replace(
                grace=False
            )  # every engine is back (or had its chance)
        self.engines = self.metrics.engines = n
        mine = self.policy_sha()
        other = frozenset(f"{e} ({sha[:12]})" for e, sha in engines if sha != mine)
        self.metrics.policy_mismatch = len(other)
        if other != self._mismatch:
            if other:
                self.log.warning(
                    "outrate: %d engine(s) sharing the budget store run another policy than "
                    "this one (%s): %s; each enforces its own limits on the shared budgets",
                    len(other),
                    mine[:12],
                    ", ".join(sorted(other)),
                )
            elif self._mismatch:
                self.log.info("outrate: every engine sharing the store runs policy %s", mine[:12])
            self._mismatch = other

    # -- faults ---------------------------------------------------------------------

    def _describe_fallback(self) -> str:
        if self.budget.fallback == "full":
            return "enforcing the full rate on each engine"
        n = self.engines
        return f"enforcing rate/{n} on each engine (last known live engines: {n})"

    def _down(self, e: Exception) -> None:
        self.metrics.errors += 1
        if self.up is False:
            return
        self._fails += 1
        if self.up and self._fails < DOWN_AFTER:
            return  # retried at the next round; credit held meanwhile still spends
        first = self.up is None
        self.up = False
        self.metrics.up = 0
        self.budget.mode = Mode(shared=False, grace=False, n=self.engines)
        for c in self.turns.active:
            c.reg = False  # Redis forgets demand by itself (TTL)
        if not first:
            self.metrics.transitions["down"] += 1
        self.log.warning(
            "outrate: budget store %s %s (%s: %s): %s until it answers again",
            self.link.url,
            "unreachable at start" if first else "lost",
            type(e).__name__,
            e,
            self._describe_fallback(),
        )

    def connect(self) -> None:
        """Try the store once; on an answer, lease at once and share again
        (what the thread does while the store is down, once per `retry_s`)."""
        try:
            self.link.ping()
        except Exception as e:
            self._down(e)
            return
        was_down = self.up is False
        # An outage is not a round period: measured across it, the first
        # round back would lease up to a second ahead (H is capped at 1 s)
        # on top of the debt. Rounds start again at the interval.
        self._last_start = 0
        self.period_ns = self.avg_period_ns = self.interval_ns
        self.last_rtt_ns = 0
        debts = None
        if was_down:
            debts = self._debts()
            for c in self.turns.active:
                c.sent = c.released  # credit from before the outage was dropped
        self.up = True
        if not self.round(debts):
            return
        self.metrics.up = 1
        if was_down:
            self._grace_end = time.monotonic_ns() + GRACE_NS
        self.budget.mode = Mode(shared=True, grace=was_down, n=self.budget.mode.n)
        if was_down:
            self.metrics.transitions["up"] += 1
        if not self._ever_up:
            self._ever_up = True
            self.log.info(
                "outrate: sharing budgets through %s (engine %s, %d live engine(s), lease "
                "interval %d ms)%s",
                self.link.url,
                self.engine,
                self.engines,
                self.interval_ns // 1_000_000,
                " after all" if was_down else "",
            )
        else:
            self.log.warning(
                "outrate: budget store %s is back: budgets shared again (%d user debt(s) "
                "carried over, no burst granted)",
                self.link.url,
                len(debts or ()),
            )

    def _debts(self) -> dict[Credit, int]:
        """What each user spent here while the store was away, in the store's
        microseconds: the local debt in tokens (TAT ahead of now), at the
        user's full rate."""
        now = self.table.clock()
        policy = self.table.policy
        out: dict[Credit, int] = {}
        for b in self.table.buckets():
            lim = b.limit
            if not lim.scale or b.tat <= now * lim.scale:
                continue
            units = self.turns.units_of(policy.limit_for(b.key))
            if units is None:
                continue
            c = credit_of(b)
            out[c] = units.us_for((b.tat - now * lim.scale) / lim.interval)
            self.turns.activate(c)
        return out

    def _leave(self) -> None:
        calls = []
        policy = self.table.policy
        for c in list(self.turns.active):
            refund = c.granted - c.spent - c.sent  # all credit, released or not
            units = self.turns.units_of(policy.limit_for(c.bucket.key))
            if units is not None and (refund > 0 or c.reg):
                calls.append(LeaseCall(c.bucket.key, units, 0, 0, 0, max(refund, 0), 0))
        self.link.round_trip(self.engine, calls, 1, (self.policy_sha(), 0))
