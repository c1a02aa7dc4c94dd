"""The lease thread of a shared budget (`--outrate-store`): `LeaseRunner`.

One per engine core. Every lease interval it sends one pipelined round trip
to Redis (outrate.budget.shared.lease) with a call for every user whose credit here ran
low, whose demand changed or whose registration is due, and the credit
users who left hand back: at most `cap` calls, what fits in about half an
interval, new users first and the others in turn (`plan`); every second a
heartbeat with this engine's id and policy sha256. It is the only writer
of a `SharedBucket`'s `granted`, `sent`, `fair`, `share`, `seen` and
registration fields (outrate.budget.shared.credit).
It also owns the faults: two failed round trips in a row switch the
`SharedLimiter` to its fallback (applied by the scheduler at the next step),
the first answer after that reports each user's local debt so nobody gets a
burst, and each switch is logged once and counted in `StoreMetrics`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from fractions import Fraction

from outrate.budget.limiter import NS_PER_S, Limit
from outrate.budget.shared.credit import LEASE_INTERVAL_S, SharedBucket, SharedLimiter
from outrate.budget.shared.lease import (
    MAX_DEMAND,
    MAX_HORIZON_US,
    MAX_TOKENS,
    LeaseCall,
    RedisLink,
    Units,
)
from outrate.budget.shared.metrics import StoreMetrics

HEARTBEAT_S = 1.0
ENGINE_TTL_S = 3.0
"""An engine that has not heartbeaten for 3 s is no longer counted."""
DEMAND_TTL_S = 2.0
"""An engine's demand for a user expires unless renewed (every 0.5 s)."""
DEMAND_REFRESH_NS = 500_000_000
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
ROUND_SHARE = 0.5
"""A round's calls are capped so that one round trip takes about this share
of the lease interval: one round trip per interval, whatever the number of
users, and at most half of Redis's time and of this thread's."""
MIN_CALLS = 128
FIRST_CALLS = 1024
"""The cap before a round trip was large enough to measure a call's cost."""


def engine_id() -> str:
    """Unique per engine-core process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class LeaseRunner:
    """The lease thread: one pipelined round trip per interval, off the hot path."""

    def __init__(
        self,
        limiter: SharedLimiter,
        link: RedisLink,
        policy_sha: Callable[[], str],
        metrics: StoreMetrics | None = None,
        engine: str | None = None,
        logger: logging.Logger | None = None,
        interval_s: float = LEASE_INTERVAL_S,
        retry_s: float = RETRY_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.limiter = limiter
        self.link = link
        self.policy_sha = policy_sha
        self.metrics = metrics or StoreMetrics()
        self.engine = engine or engine_id()
        self.log = logger or logging.getLogger("vllm.outrate")
        self.interval_ns = int(interval_s * NS_PER_S)
        self.retry_s = retry_s
        self.heartbeat_ns = int(heartbeat_s * NS_PER_S)
        self.active: dict[SharedBucket, None] = {}
        """Users with a lease here; visited in turn through `_ring`, new ones
        (`_fresh`) first."""
        self._ring: deque[SharedBucket] = deque()
        self._fresh: deque[SharedBucket] = deque()
        self.cap = FIRST_CALLS
        """Most lease calls one round sends (`_fit`)."""
        self.call_ns = 0.0
        """What one lease call costs, Redis or this thread (a moving average)."""
        self.up: bool | None = None  # None: not tried yet
        self._fails = 0  # consecutive failed round trips
        self._grace_end = 0
        self._ever_up = False
        self.period_ns = self.interval_ns
        self.avg_period_ns = self.interval_ns
        """Moving average of the period (1/8 weight to the newest)."""
        self.last_rtt_ns = 0
        self.max_horizon_us = 0
        """The longest horizon sent (the bound's H; tests and the benchmark)."""
        self.late_ns = 0
        """Time this thread started rounds late: the sum over rounds of what
        the period exceeded two intervals by (a starved process, a slow store).
        Counted only while users hold leases here: their credit runs dry while
        it is late, so tests discount it from the rate they expect."""
        self._last_beat = 0
        self._last_start = 0
        self._mismatch: frozenset[str] = frozenset()
        self._units: dict[Limit, Units | None] = {}
        self._units_by_id: dict[int, tuple[Limit, Units | None]] = {}
        self._stopping = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outrate-lease", daemon=True)

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Try the store once right here (at most 2 x `TIMEOUT_S`), so requests
        arriving right after start are already shared, then keep leasing in
        the thread. An unreachable store is logged, and retried there."""
        self._try_connect()
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, then hand back every credit held and leave."""
        self._stopping = True
        self._stop.set()
        self.limiter.kick.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        if self.up:
            try:
                self._leave()
            except Exception as e:  # best effort: leases expire in Redis anyway
                self.log.info("outrate: could not hand leases back on shutdown: %s", e)
        self.link.close()

    def _run(self) -> None:
        lim = self.limiter
        next_round = time.monotonic_ns()
        while not self._stopping:
            if not self.up:
                if self._stop.wait(self.retry_s):
                    return
                self._drain_arrivals()
                self._try_connect()
                next_round = time.monotonic_ns()
                continue
            delay = next_round - time.monotonic_ns()
            if delay > 0:
                if lim.kick.wait(delay / NS_PER_S):
                    lim.kick.clear()
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

    def _drain_arrivals(self) -> None:
        arrivals = self.limiter.arrivals
        while arrivals:
            self._activate(arrivals.popleft())

    def _activate(self, b: SharedBucket) -> None:
        if b not in self.active:
            b.leased = True
            self.active[b] = None
            self._fresh.append(b)

    def _units_of(self, lim: Limit) -> Units | None:
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

    def _horizon_us(self) -> int:
        """The lease horizon H: how long one slice must last. The engine
        reports its credit when a round is planned and the grant lands one
        round trip later; the next grant lands one period after that. So H
        is the period plus the last round trip (at least the lease interval,
        at most 1 s). With a fast store that is ~20 ms; when rounds are slow
        (a slow store, tens of thousands of users) it grows with them, and
        the script grants what conforms within H: a slow store costs slack,
        not throughput. With the period alone, back-to-back rounds granted
        every other round's need: ~60% of the rate in the slow-rounds test.

        When the users with a lease outnumber a round's cap, each is visited
        once every `ceil(users / cap)` rounds, and its slice must last that
        many periods: H grows with the users, the round trips do not. The
        periods after the next are taken at their moving average, so that
        one late round (a burst of new users) is not multiplied by the
        number of rounds."""
        rounds = max(1, -(-len(self.active) // self.cap))
        cycle = self.period_ns + (rounds - 1) * self.avg_period_ns
        h = max(self.interval_ns, cycle + self.last_rtt_ns)
        return min(h // 1000, MAX_HORIZON_US)

    def plan(
        self, now: int, debts: dict[SharedBucket, int] | None = None
    ) -> list[tuple[SharedBucket, LeaseCall]]:
        """The calls of one round: users below their slice, users whose demand
        changed or must be renewed, credit to hand back. New users first,
        then the others in turn from where the last round stopped, until
        `cap` calls (all users, when reporting `debts` after an outage)."""
        self._drain_arrivals()
        policy = self.limiter.policy
        horizon = self._horizon_us()
        cap = self.cap if debts is None else len(self.active) + 1
        out: list[tuple[SharedBucket, LeaseCall]] = []
        fresh, ring = self._fresh, self._ring
        turns = len(ring)
        while fresh and len(out) < cap:
            b = fresh.popleft()
            if self._visit(b, policy.limit_for(b.key), now, horizon, debts, out):
                ring.append(b)
        while turns and len(out) < cap:
            turns -= 1
            b = ring.popleft()
            if self._visit(b, policy.limit_for(b.key), now, horizon, debts, out):
                ring.append(b)
        return out

    def _visit(
        self,
        b: SharedBucket,
        lim: Limit,
        now: int,
        horizon: int,
        debts: dict[SharedBucket, int] | None,
        out: list[tuple[SharedBucket, LeaseCall]],
    ) -> bool:
        """Add `b`'s call to `out` if it needs one. False: `b` left the lease."""
        units = self._units_of(lim)
        refund = b.released - b.sent
        pins = b.pins
        if units is None:  # unlimited (or not shareable): nothing to lease
            if pins == 0 or not b.reg:
                self._drop(b)
                return False
            pins = 0
        credit = b.granted - b.spent - b.released
        debt = debts.get(b, 0) if debts else 0
        if pins == 0:
            if not refund and not b.reg and not debt:
                if credit > 0:
                    self.limiter.settle.append(b)  # released at the next step
                else:
                    self._drop(b)
                    return False
                return True
            if units is None:
                units = Units(1, 1, 0)  # only deregisters: no token moves
            out.append((b, LeaseCall(b.key, units, 0, 0, 0, refund, 0, debt)))
            return True
        d = min(pins, MAX_DEMAND)
        assert units is not None
        register = not b.reg or d != b.demand or now - b.reg_at > DEMAND_REFRESH_NS
        # Low: below the slice, or (for users far from their rate) below
        # twice what they spent since the last visit.
        spent = b.spent
        low = credit < max(1, min(b.fair, 2 * (spent - b.seen) + 1))
        b.seen = spent
        if low or refund or debt or register:
            call = LeaseCall(
                b.key, units, d, max(credit, 0), MAX_TOKENS, refund, horizon, debt, register
            )
            out.append((b, call))
            if horizon > self.max_horizon_us:
                self.max_horizon_us = horizon
        return True

    def _drop(self, b: SharedBucket) -> None:
        b.leased = False
        self.active.pop(b, None)

    def round(self, debts: dict[SharedBucket, int] | None = None) -> bool:
        """One round trip. Returns False (and switches to the fallback) on error."""
        start = time.monotonic_ns()
        if self._last_start:
            self.period_ns = start - self._last_start
            self.avg_period_ns += (self.period_ns - self.avg_period_ns) // 8
            if self.period_ns > 2 * self.interval_ns and self.active:
                self.late_ns += self.period_ns - 2 * self.interval_ns
        self._last_start = start
        plan = self.plan(start, debts)
        beat = None
        if start - self._last_beat >= self.heartbeat_ns:
            beat = (self.policy_sha(), int(ENGINE_TTL_S * 1_000_000))
        if not plan and beat is None:
            self.limiter.next_credit_ns = start + self.interval_ns
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
        self._fit(len(plan))
        self.limiter.next_credit_ns = start + self.interval_ns + self.last_rtt_ns
        settle = self.limiter.settle
        for (b, c), g in zip(plan, grants, strict=True):
            if g.granted:
                b.granted += g.granted
                if b.pins == 0:
                    settle.append(b)
            b.sent += c.refund
            b.fair = g.fair
            if c.demand and g.demand:
                share = Fraction(c.demand, g.demand)
                if share != b.share:
                    b.share = share  # the scheduler re-resolves its local limit
            b.demand = c.demand
            b.reg = c.demand > 0
            if c.register:
                b.reg_at = start
        if engines is not None:
            self._last_beat = start
            self._engines(engines)
        return True

    def _fit(self, n: int) -> None:
        """Re-size `cap` from the last round trip: what one call cost (its
        replies after the first, plus packing), so that a round takes about
        `ROUND_SHARE` of the interval. Network latency does not count: a
        slow but idle store keeps large rounds."""
        link = self.link
        m = link.spread_calls
        if m < 64:
            return
        per = link.spread_ns / m + link.pack_ns / n
        self.call_ns = per if not self.call_ns else (3 * self.call_ns + per) / 4
        self.cap = max(MIN_CALLS, int(self.interval_ns * ROUND_SHARE / max(self.call_ns, 1.0)))

    def _engines(self, engines: list[tuple[str, str]]) -> None:
        n = max(1, len(engines))
        lim = self.limiter
        if lim.want_grace and (n >= lim.fallback_n or time.monotonic_ns() > self._grace_end):
            lim.want_grace = False  # every engine is back (or had its chance)
        lim.engines = n
        self.metrics.engines = n
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
        lim = self.limiter
        if lim.fallback == "full":
            return "enforcing the full rate on each engine"
        return (
            f"enforcing rate/{lim.engines} on each engine (last known live engines: {lim.engines})"
        )

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
        self.limiter.want_shared = False
        for b in self.active:
            b.reg = False  # Redis forgets demand by itself (TTL)
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

    def _try_connect(self) -> None:
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
            for b in self.active:
                b.sent = b.released  # credit from before the outage was dropped
        self.up = True
        if not self.round(debts):
            return
        self.metrics.up = 1
        if was_down:
            self.limiter.want_grace = True
            self._grace_end = time.monotonic_ns() + GRACE_NS
        self.limiter.want_shared = True
        if was_down:
            self.metrics.transitions["up"] += 1
        if not self._ever_up:
            self._ever_up = True
            self.log.info(
                "outrate: sharing budgets through %s (engine %s, %d live engine(s), lease "
                "interval %d ms)%s",
                self.link.url,
                self.engine,
                self.limiter.engines,
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

    def _debts(self) -> dict[SharedBucket, int]:
        """What each user spent here while the store was away, in the store's
        microseconds: the local debt in tokens (TAT ahead of now), at the
        user's full rate."""
        now = self.limiter.clock()
        out: dict[SharedBucket, int] = {}
        for b in list(self.limiter._buckets.values()):
            sb: SharedBucket = b  # type: ignore[assignment]
            lim = sb.limit
            if not lim.scale or sb.tat <= now * lim.scale:
                continue
            full = self.limiter.policy.limit_for(sb.key)
            units = self._units_of(full)
            if units is None:
                continue
            tokens = (sb.tat - now * lim.scale) / lim.interval
            out[sb] = units.us_for(tokens)
            self._activate(sb)
        return out

    def _leave(self) -> None:
        calls = []
        for b in list(self.active):
            refund = b.granted - b.spent - b.sent  # all credit, released or not
            units = self._units_of(self.limiter.policy.limit_for(b.key))
            if units is not None and (refund > 0 or b.reg):
                calls.append(LeaseCall(b.key, units, 0, 0, 0, max(refund, 0), 0))
        self.link.round_trip(self.engine, calls, 1, (self.policy_sha(), 0))
