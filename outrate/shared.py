"""A budget shared by several engines: local credit, leased from Redis.

`SharedLimiter` is the second `BudgetStore` (outrate.store). The scheduler
talks to it exactly as to `Limiter`, and its hot path stays in memory: a
token is taken when the user's local GCRA conforms (as on one engine) *and*
the engine holds leased credit for the user. `LeaseRunner`, a thread in the
engine core, keeps that credit topped up from the global GCRA in Redis
(outrate.lease): once per lease interval it sends one pipelined round trip
with a call for every user whose credit ran below its slice, and returns
credit that users who left this engine no longer need.

Fields of a `SharedBucket` have one writer each, so the two threads never
lock: the lease thread writes `granted` and `sent`, the scheduler `spent`
and `released`; credit is `granted - spent - released`. Credit a bucket no
longer needs is moved to `released` by the scheduler (when its last request
leaves, or at the next step when a grant arrives after that) and sent back
by the lease thread.

The bound (README "Several engines"): in any window W a user's tokens summed
over all engines stay within `(W + burst) * rate + 1 + S`, where S is the
credit outstanding at the window's start. An engine holds at most its fair
slice `max(1, ceil(rate * H * d_e / D))` (H the lease horizon, d_e its
requests of the user, D everyone's), so S <= rate * H + N for N engines
serving the user.

When the store cannot be reached the scheduler keeps going on local GCRA
alone, at `rate / N` per engine (N: live engines at the last heartbeat) or
at the full rate (`fallback="full"`). Mode switches happen at a step
boundary (`cleanup`, `pin`) in the scheduler's thread.
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
from typing import TYPE_CHECKING

from outrate.lease import (
    MAX_DEMAND,
    MAX_HORIZON_US,
    MAX_TOKENS,
    LeaseCall,
    RedisLink,
    Units,
)
from outrate.limiter import NS_PER_S, Bucket, Limit, Limiter, LimitSource
from outrate.metrics import StoreMetrics

if TYPE_CHECKING:
    from outrate.compiler import CompiledPolicy

LEASE_INTERVAL_S = 0.02
"""One round trip per 20 ms: a fifth of the default 100 ms burst, so four
engines' slices (rate * 20 ms in all) stay well inside one burst, and ~50
round trips/s per engine cost Redis nothing. A user's first token waits at
most half an interval (new users wake the lease thread early, at most twice
per interval) plus one round trip."""
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
DOWN_AFTER = 2
"""Consecutive failed round trips before an engine falls back: one slow
answer on a loaded machine (a starved process, not a slow store) is
retried at the next round instead of switching modes."""
FALLBACKS = ("share", "full")
FULL = Fraction(1)


class SharedBucket(Bucket):
    __slots__ = (
        "granted",
        "spent",
        "released",
        "sent",
        "fair",
        "demand",
        "reg_at",
        "leased",
        "reg",
        "share",
        "used",
        "seen",
    )

    def __init__(self, key: str, limit: Limit, gen: int) -> None:
        super().__init__(key, limit, gen)
        self.granted = 0  # lease thread: tokens Redis granted to this engine
        self.spent = 0  # scheduler: tokens taken (net of give_back)
        self.released = 0  # scheduler: credit handed back
        self.sent = 0  # lease thread: released credit returned to Redis
        self.fair = 0  # lease thread: the last fair slice Redis computed
        self.demand = 0  # lease thread: the demand last reported
        self.reg_at = 0  # lease thread: when it last wrote its demand to Redis
        self.leased = False  # lease thread: in its active set (keep the bucket)
        self.reg = False  # lease thread: demand registered in Redis
        self.share = FULL  # lease thread: this engine's share of the user's demand
        self.used: Fraction | None = None  # scheduler: the share its limit was resolved with
        self.seen = 0  # lease thread: `spent` at its last round

    @property
    def credit(self) -> int:
        return self.granted - self.spent - self.released


class SharedLimiter(Limiter):
    """A `Limiter` whose takes also spend credit leased from a shared store."""

    _bucket_cls = SharedBucket

    def __init__(
        self,
        policy: CompiledPolicy,
        clock: Callable[[], int] = time.monotonic_ns,
        fallback: str = "share",
        engines_hint: int = 1,
        interval_s: float = LEASE_INTERVAL_S,
    ) -> None:
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        super().__init__(policy, clock)
        self.fallback = fallback
        self.shared = False
        """Applied mode (scheduler thread): True spends leased credit."""
        self.want_shared = False
        """Requested mode (lease thread); applied at the next step boundary."""
        self.engines = max(1, engines_hint)
        """Live engines by the last heartbeat (lease thread)."""
        self.fallback_n = self.engines
        """N of the fallback in force: `engines` when the store went away."""
        self._scaled: dict[tuple[Limit, Fraction], Limit] = {}
        self.arrivals: deque[SharedBucket] = deque()
        """Buckets whose first request arrived (scheduler -> lease thread)."""
        self.settle: deque[SharedBucket] = deque()
        """Buckets granted credit after their last request left (lease -> scheduler)."""
        self.kick = threading.Event()
        self.interval_ns = int(interval_s * NS_PER_S)
        self.next_credit_ns = 0
        """When the next lease round is expected to have answered (lease thread)."""

    # -- modes -----------------------------------------------------------------

    def _local(self, b: Bucket, lim: Limit) -> Limit:
        """The local limit: the policy's rate times this engine's share of
        the user's demand (shared), or times 1/N (fallback `share`). Pacing
        each engine at its share is what makes engines share fairly: without
        it, the engine whose lease calls happen to land first after each
        token conforms in Redis would take them all."""
        sb: SharedBucket = b  # type: ignore[assignment]
        share = sb.used = sb.share
        if lim.rate is None:
            return lim
        if not self.shared:
            if self.fallback == "full" or self.fallback_n <= 1:
                return lim
            share = Fraction(1, self.fallback_n)
        if share >= 1:
            return lim
        key = (lim, share)
        scaled = self._scaled.get(key)
        if scaled is None:
            if len(self._scaled) > 10_000:
                self._scaled.clear()
            scaled = Limit(
                lim.rate * share,
                lim.burst_ns,
                lim.max_streams,
                lim.rule,
                lim.shadow,
                lim.label,
            )
            self._scaled[key] = scaled
        return scaled

    def _apply_mode(self) -> None:
        """Scheduler thread, between steps. Leaving shared mode drops the
        credit held (it was leased before the outage; dropping it never
        grants anything); either way every bucket re-resolves its limit and
        keeps its debt in tokens (Limiter._refresh)."""
        want = self.want_shared
        if want == self.shared:
            return
        if not want:
            for b in list(self._buckets.values()):
                sb: SharedBucket = b  # type: ignore[assignment]
                sb.spent = sb.granted - sb.released
            self.fallback_n = self.engines
        self._scaled.clear()
        self.shared = want
        self._gen += 1

    def set_policy(self, policy: LimitSource, now: int | None = None) -> None:
        self._scaled.clear()
        super().set_policy(policy, now)

    # -- the scheduler's verbs -------------------------------------------------

    def pin(self, user: str) -> Bucket:
        if self.want_shared is not self.shared:
            self._apply_mode()
        b = super().pin(user)
        if b.pins == 1:
            self.arrivals.append(b)  # type: ignore[arg-type]
            self.kick.set()
        return b

    def unpin(self, b: Bucket) -> None:  # type: ignore[override]
        b.pins -= 1
        if b.pins == 0 and self.shared:
            sb: SharedBucket = b  # type: ignore[assignment]
            c = sb.granted - sb.spent - sb.released
            if c > 0:
                sb.released += c

    def take(self, b: Bucket, now: int) -> bool:
        if b.gen != self._gen or b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        lim = b.limit
        s = lim.scale
        if not s:
            return True
        shared = self.shared
        if shared and b.granted - b.spent - b.released <= 0:  # type: ignore[attr-defined]
            return False
        now_s = now * s
        tat = b.tat
        if tat < now_s:
            tat = now_s
        elif tat - now_s > lim.tolerance:
            return False
        b.tat = tat + lim.interval
        if shared:
            b.spent += 1  # type: ignore[attr-defined]
        return True

    def give_back(self, b: Bucket, now: int) -> None:
        super().give_back(b, now)
        if self.shared and b.limit.scale:
            b.spent -= 1  # type: ignore[attr-defined]

    def limit_of(self, b: Bucket, now: int) -> Limit:
        if b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        return super().limit_of(b, now)

    def ready_at(self, b: Bucket, now: int) -> int:
        if b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        t = super().ready_at(b, now)
        if self.shared and b.limit.scale and b.credit <= 0:  # type: ignore[attr-defined]
            nxt = self.next_credit_ns
            if nxt <= now:
                nxt = now + self.interval_ns // 4
            return max(t, nxt)
        return t

    def available(self, b: Bucket, now: int) -> int:
        if b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        n = super().available(b, now)
        if self.shared and b.limit.scale:
            c: int = b.credit  # type: ignore[attr-defined]
            return min(n, c) if c > 0 else 0
        return n

    def cleanup(self, now: int | None = None, budget: int = 64) -> int:
        if self.want_shared is not self.shared:
            self._apply_mode()
        settle = self.settle
        while settle:
            b = settle.popleft()
            if b.pins == 0 and self.shared:
                c = b.granted - b.spent - b.released
                if c > 0:
                    b.released += c
        return super().cleanup(now, budget)

    def _forgettable(self, b: Bucket, now: int) -> bool:
        return super()._forgettable(b, now) and not b.leased  # type: ignore[attr-defined]


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
        self.up: bool | None = None  # None: not tried yet
        self._fails = 0  # consecutive failed round trips
        self._ever_up = False
        self.period_ns = self.interval_ns
        self.last_rtt_ns = 0
        self._last_beat = 0
        self._last_start = 0
        self._mismatch: frozenset[str] = frozenset()
        self._units: dict[Limit, Units | None] = {}
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
        active = self.active
        while arrivals:
            b = arrivals.popleft()
            if b not in active:
                b.leased = True
                active[b] = None

    def _units_of(self, lim: Limit) -> Units | None:
        if lim not in self._units:
            try:
                self._units[lim] = Units.of(lim) if lim.rate is not None else None
            except ValueError as e:
                self.log.warning("outrate: %s: kept local, not shared: %s", lim.rule, e)
                self._units[lim] = None
        return self._units[lim]

    def _horizon_us(self) -> int:
        """The lease horizon H: what one slice must last until the next
        answer. The lease interval, or the measured round-trip period when
        rounds take longer (a slow store, tens of thousands of users), at
        most 1 s: a slow store costs slack (rate * H), not throughput."""
        h = max(self.interval_ns, self.period_ns)
        return min(h // 1000, MAX_HORIZON_US)

    def plan(
        self, now: int, debts: dict[SharedBucket, int] | None = None
    ) -> list[tuple[SharedBucket, LeaseCall]]:
        """The calls of one round: users below their slice, users whose demand
        changed or must be renewed, credit to hand back."""
        self._drain_arrivals()
        policy = self.limiter.policy
        out = []
        for b in list(self.active):
            lim = policy.limit_for(b.key)
            units = self._units_of(lim)
            refund = b.released - b.sent
            pins = b.pins
            if units is None:  # unlimited (or not shareable): nothing to lease
                if pins == 0 or not b.reg:
                    self._drop(b)
                    continue
                pins = 0
            credit = b.granted - b.spent - b.released
            debt = debts.get(b, 0) if debts else 0
            if pins == 0:
                if not refund and not b.reg and not debt:
                    if credit > 0:
                        self.limiter.settle.append(b)  # released at the next step
                    else:
                        self._drop(b)
                    continue
                if units is None:
                    units = Units(1, 1, 0)  # only deregisters: no token moves
                out.append((b, LeaseCall(b.key, units, 0, 0, 0, refund, 0, debt)))
                continue
            d = min(pins, MAX_DEMAND)
            assert units is not None
            register = not b.reg or d != b.demand or now - b.reg_at > DEMAND_REFRESH_NS
            # Low: below the slice, or (for users far from their rate) below
            # twice what they spent since the last round.
            spent = b.spent
            low = credit < max(1, min(b.fair, 2 * (spent - b.seen) + 1))
            b.seen = spent
            if low or refund or debt or register:
                call = LeaseCall(
                    b.key,
                    units,
                    d,
                    max(credit, 0),
                    MAX_TOKENS,
                    refund,
                    self._horizon_us(),
                    debt,
                    register,
                )
                out.append((b, call))
        return out

    def _drop(self, b: SharedBucket) -> None:
        b.leased = False
        self.active.pop(b, None)

    def round(self, debts: dict[SharedBucket, int] | None = None) -> bool:
        """One round trip. Returns False (and switches to the fallback) on error."""
        start = time.monotonic_ns()
        if self._last_start:
            self.period_ns = start - self._last_start
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

    def _engines(self, engines: list[tuple[str, str]]) -> None:
        n = max(1, len(engines))
        self.limiter.engines = n
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
        debts = None
        if was_down:
            debts = self._debts()
            for b in self.active:
                b.sent = b.released  # credit from before the outage was dropped
        self.up = True
        if not self.round(debts):
            return
        self.metrics.up = 1
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
            if sb not in self.active:
                sb.leased = True
                self.active[sb] = None
        return out

    def _leave(self) -> None:
        calls = []
        for b in list(self.active):
            refund = b.granted - b.spent - b.sent  # all credit, released or not
            units = self._units_of(self.limiter.policy.limit_for(b.key))
            if units is not None and (refund > 0 or b.reg):
                calls.append(LeaseCall(b.key, units, 0, 0, 0, max(refund, 0), 0))
        self.link.round_trip(self.engine, calls, 1, (self.policy_sha(), 0))
