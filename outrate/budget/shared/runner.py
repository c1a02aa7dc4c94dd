"""The lease thread of a shared budget (`--outrate-store`): `LeaseRunner`.

One per engine core. Every lease interval it sends one pipelined round trip
to Redis (outrate.budget.shared.lease) with the calls `Turns` plans
(outrate.budget.shared.turns: at most `ROUND_CALLS` of them, newcomers
first, then the others in turn), and every second a heartbeat with this
engine's id and policy sha256. The slice each call asks for lasts the
horizon H: until the user's next turn, that many measured periods, plus a
round trip.

It meets the faults; `Faults` (outrate.budget.shared.faults) decides and
says so by publishing one `Mode` record (outrate.budget.shared.credit),
which the scheduler applies at its next step:
two failed round trips in a row switch to the fallback (rate/N locally; the
others leave this engine its part for the hold, `hold_s`:
outrate.budget.shared.peers), for as long as the outage lasts (`local`) or
for the hold, then limited users wait for the store (`pause`); the first
answer after that reports each user's local debt so nobody gets a burst,
and starts a grace at rate/N until the other engines are back. A store
never reached is a fallback too, at rate/N with N the engines expected
(`pause`: limited users wait); one that refuses this engine at start (a
wrong password) stops the start. State lost under the engine (an epoch changed:
FLUSHALL, a restart) is answered in the script, and the users of that group
not in the call are marked for it. Each switch is logged once and counted
in `StoreMetrics`.

Prompt budgets (`prompt:` limits) are shared the same way, by the same
thread in the same rounds: the scheduler's prompt table is a second
`Limiter` lent by a second `SharedBudget` (`prompts=`), its users have their
own keys and their own global GCRA (outrate.budget.shared.lease, `PROMPT`),
and one `Mode` is published to both, so the two kinds fall back, wait and
come back together, with the same bound.
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
from typing import NamedTuple

from outrate.budget.limiter import NS_PER_S, Limiter
from outrate.budget.shared.credit import LEASE_INTERVAL_S, Credit, SharedBudget, credit_of
from outrate.budget.shared.faults import DOWN_AFTER as DOWN_AFTER  # (re-exported)
from outrate.budget.shared.faults import Faults
from outrate.budget.shared.faults import StoreRefused as StoreRefused  # (re-exported)
from outrate.budget.shared.lease import (
    MAX_HORIZON_US,
    OUTPUT,
    PROMPT,
    LeaseCall,
    RedisLink,
    Round,
    group_of,
)
from outrate.budget.shared.metrics import StoreMetrics
from outrate.budget.shared.peers import HOLD_S, Peers
from outrate.budget.shared.turns import ROUND_CALLS, Turns

HEARTBEAT_S = 1.0
ENGINE_TTL_S = 3.0
"""An engine that has not heartbeaten for 3 s is no longer counted."""
DEMAND_TTL_S = 5.0
"""An engine's demand for a user expires unless renewed (every 0.5 s): past
the time the others take to see its heartbeat missing (`ENGINE_TTL_S` and
one heartbeat), so an engine cut off is counted in their shares until they
leave it its part instead (outrate.budget.shared.peers)."""
RETRY_S = 1.0
"""While the store is down, how often the lease thread tries again."""
TIMEOUT_S = 0.5
"""A round trip slower than this fails."""
GRACE_NS = int((RETRY_S + HEARTBEAT_S + ENGINE_TTL_S) * NS_PER_S)
"""After the store is back, each engine stays within rate/N until the
heartbeats show every engine back, at most this long (the others retry once
a second; a dead one's heartbeat expires)."""
RESET_LOG_NS = 10 * NS_PER_S
"""State lost under the engine is logged at most once per 10 s (a FLUSHALL
is found group by group, and a script may flush every few hundred ms)."""


class Kind(NamedTuple):
    """One kind of budget the lease thread shares: the scheduler's table of
    it, the budget that lends that table credit, and whom to call in turn."""

    table: Limiter
    budget: SharedBudget
    turns: Turns


def engine_id() -> str:
    """Unique per engine-core process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class LeaseRunner:
    """The lease thread: one pipelined round trip per interval, off the hot path.

    `table` is the scheduler's `Limiter`, lent by `budget`: the runner reads
    its policy, clock and buckets (`buckets()`), and talks to the scheduler
    through `budget` only. `prompts`, where the policy limits prompts: the
    scheduler's prompt table and the budget lending it, shared alike.
    `kind`: what `table` counts (outrate.budget.shared.lease: `OUTPUT`; an
    API server's request table leases `REQUESTS`)."""

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
        hold_s: float = HOLD_S,
        expected_from: str = "the engines expected: 1",
        prompts: tuple[Limiter, SharedBudget] | None = None,
        kind: str = OUTPUT,
    ) -> None:
        if table.lender is not budget:
            raise ValueError("the table must be lent by this budget (Limiter(lender=budget))")
        if prompts is not None and prompts[0].lender is not prompts[1]:
            raise ValueError("the prompt table must be lent by its budget")
        self.table = table
        self.budget = budget
        self.link = link
        self.policy_sha = policy_sha
        self.metrics = metrics or StoreMetrics()
        self.engine = engine or engine_id()
        self.log = logger or logging.getLogger("vllm.outrate")
        self.turns = Turns(budget, self.log, cap, kind)
        self.kinds = [Kind(table, budget, self.turns)]
        self.interval_ns = int(interval_s * NS_PER_S)
        self.retry_s = retry_s
        self.heartbeat_ns = int(heartbeat_s * NS_PER_S)
        self.peers = Peers(self.metrics, self.log, budget.mode.n, hold_s)
        self.faults = Faults(
            budget,
            self.metrics,
            self.peers,
            self.turns,
            self.log,
            link.url,
            int(hold_s * NS_PER_S),
            GRACE_NS,
            expected_from,
        )
        if prompts is not None:
            ptable, pbudget = prompts
            pbudget.kick = budget.kick  # one thread: either kind's newcomer wakes it
            pturns = Turns(pbudget, self.log, cap, PROMPT)
            self.kinds.append(Kind(ptable, pbudget, pturns))
            self.faults.follow(pbudget, pturns)
        self.metrics.hold_s = hold_s
        # What the others keep for this engine once its heartbeat is gone:
        # its fallback, plus a retry and a connect it may be late by.
        self._hold_us = int((hold_s + retry_s + 2 * TIMEOUT_S) * 1_000_000)
        self._last_error: Exception | None = None
        self._reset_logged = -RESET_LOG_NS
        self._resets_unlogged = 0
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
        self._stopping = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outrate-lease", daemon=True)

    @property
    def up(self) -> bool | None:
        """The store answers (None: not tried yet)."""
        return self.faults.up

    @property
    def engines(self) -> int:
        """Live engines by the last heartbeat (the hint until one answered)."""
        return self.peers.live

    @property
    def max_horizon_us(self) -> int:
        """The longest horizon sent (the bound's H), over every kind."""
        return max(k.turns.max_horizon_us for k in self.kinds)

    def _drain(self) -> None:
        for k in self.kinds:
            k.turns.drain()

    def _active(self) -> list[Credit]:
        """Every credit with a lease here, of every kind."""
        return [c for k in self.kinds for c in k.turns.active]

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Try the store once right here (at most 2 x `TIMEOUT_S`; unless it
        answered already), so requests arriving right after start are already
        shared, then keep leasing in the thread. An unreachable store is
        logged, and retried there; one that refuses this engine raises
        `StoreRefused` (unless the fallback is `full`)."""
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
                left = self.faults.hold_left_s()
                if self._stop.wait(self.retry_s if left is None else min(self.retry_s, left)):
                    return
                if self.faults.hold_ran_out():
                    continue
                self._drain()
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
        rounds = max(k.turns.rounds() for k in self.kinds)
        cycle = self.period_ns + (rounds - 1) * self.avg_period_ns
        h = max(self.interval_ns, cycle + self.last_rtt_ns)
        return min(h // 1000, MAX_HORIZON_US)

    def round(self, debts: dict[Credit, int] | None = None) -> bool:
        """One round trip. Returns False (and counts a failure) on error."""
        start = time.monotonic_ns()
        if self._last_start:
            self.period_ns = start - self._last_start
            self.avg_period_ns += (self.period_ns - self.avg_period_ns) // 8
            late = self.period_ns > 2 * self.interval_ns
            if late and any(k.turns.active for k in self.kinds):
                self.late_ns += self.period_ns - 2 * self.interval_ns
        self._last_start = start
        self._drain()
        horizon = self.horizon_us()
        plan = [p for k in self.kinds for p in k.turns.plan(k.table.policy, start, horizon, debts)]
        beat = None
        if start - self._last_beat >= self.heartbeat_ns:
            beat = (self.policy_sha(), int(ENGINE_TTL_S * 1_000_000))
        if not plan and beat is None:
            self._next_credit(start + self.interval_ns)
            return True
        got = Round()
        hold = (self._hold_us, self.peers.n)
        try:
            self.link.round_trip(
                self.engine, [c for _, c in plan], int(DEMAND_TTL_S * 1_000_000), beat, got, hold
            )
            error = None
        except Exception as e:
            error = e
        self._apply(plan, got, start)
        if error is not None:
            self._last_error = error
            self.faults.failed(error)
            return False
        end = time.monotonic_ns()
        self.faults.answered()
        m = self.metrics
        m.round_trips += 1
        m.calls += len(plan)
        m.lease.observe(end - start)
        self.last_rtt_ns = end - start
        self._next_credit(start + self.interval_ns + self.last_rtt_ns)
        if got.engines is not None:
            self._last_beat = start
            self._engines(got.engines, got.missing)
        return True

    def _next_credit(self, at: int) -> None:
        for k in self.kinds:
            k.budget.next_credit_ns = at

    def _apply(self, plan: list[tuple[Credit, LeaseCall]], got: Round, start: int) -> None:
        """Take in what answered (on a cluster, some shards may not have)."""
        budgets = {k.turns.kind: k.budget for k in self.kinds}
        grants = got.grants or [None] * len(plan)
        for (c, call), g in zip(plan, grants, strict=True):
            if g is None:
                continue
            budget = budgets[call.kind]
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
            if call.lost:
                c.lost = False
        if got.resets:
            self._resets(got.resets, {c for c, _ in plan})
        nodes, m = self.link.nodes, self.metrics
        for line in nodes.news:
            self.log.warning("outrate: budget store %s: %s", self.link.url, line)
        nodes.news.clear()
        m.failovers = nodes.failovers
        m.redirects = dict(nodes.redirects)
        m.primaries = nodes.primaries()

    def _resets(self, groups: set[int], called: set[Credit]) -> None:
        """Groups whose state was lost: the script already assumed the worst
        for the users it was called for; the others of those groups are
        marked, so their next call does."""
        for c in self._active():
            if c not in called and group_of(c.bucket.key) in groups:
                c.lost = True
        self.metrics.resets += len(groups)
        self._resets_unlogged += len(groups)
        now = time.monotonic_ns()
        if now - self._reset_logged >= RESET_LOG_NS:
            self.log.warning(
                "outrate: budget store %s lost the state of %d group(s) of users under this "
                "engine since the last such line (FLUSHALL, FLUSHDB, a restart without "
                "persistence): each of their users is charged as far as the lost state may "
                "have reached, so nobody gains a token from it",
                self.link.url,
                self._resets_unlogged,
            )
            self._reset_logged = now
            self._resets_unlogged = 0

    def _engines(self, engines: list[tuple[str, str, int]], missing: list[tuple[str, int]]) -> None:
        self.peers.heard(engines, missing, self.policy_sha(), self._hold_us)
        self.faults.heard()

    # -- faults (outrate.budget.shared.faults) ---------------------------------------

    def connect(self) -> None:
        """Try the store once; on an answer, lease at once and share again
        (what the thread does while the store is down, once per `retry_s`).
        At start, a store that refuses this engine raises `StoreRefused`."""
        faults = self.faults
        first = faults.up is None
        try:
            self.link.ping()
        except Exception as e:
            faults.refuse(e, first)
            faults.failed(e)
            return
        was_down = faults.up is False
        # An outage is not a round period: measured across it, the first
        # round back would lease up to a second ahead (H is capped at 1 s)
        # on top of the debt. Rounds start again at the interval.
        self._last_start = 0
        self.period_ns = self.avg_period_ns = self.interval_ns
        self.last_rtt_ns = 0
        debts = None
        if was_down:
            debts = self._debts()
            for c in self._active():
                c.sent = c.released  # credit from before the outage was dropped
        # Still down (or not tried) until this round answers: a store that
        # pings but does not serve (a cluster with a shard down) stays lost,
        # counted, not logged again.
        if not self.round(debts):
            if self._last_error is not None:
                faults.refuse(self._last_error, first)
            return
        where = (
            f"engine {self.engine}, {self.engines} live engine(s), lease interval "
            f"{self.interval_ns // 1_000_000} ms, primary {', '.join(self.metrics.primaries)}"
        )
        faults.back(was_down, len(debts or ()), where)

    def _debts(self) -> dict[Credit, int]:
        """What each user spent here while the store was away, in the store's
        microseconds: the local debt in tokens (TAT ahead of now), at the
        user's full rate (of each kind)."""
        out: dict[Credit, int] = {}
        for table, _, turns in self.kinds:
            now = table.clock()
            policy = table.policy
            for b in table.buckets():
                lim = b.limit
                if not lim.scale or b.tat <= now * lim.scale:
                    continue
                units = turns.units_of(policy.limit_for(b.key))
                if units is None:
                    continue
                c = credit_of(b)
                out[c] = units.us_for((b.tat - now * lim.scale) / lim.interval)
                turns.activate(c)
        return out

    def _leave(self) -> None:
        calls = []
        for table, _, turns in self.kinds:
            policy = table.policy
            for c in list(turns.active):
                refund = c.granted - c.spent - c.sent  # all credit, released or not
                units = turns.units_of(policy.limit_for(c.bucket.key))
                if units is not None and (refund > 0 or c.reg):
                    calls.append(
                        LeaseCall(c.bucket.key, units, 0, 0, 0, max(refund, 0), 0, kind=turns.kind)
                    )
        self.link.round_trip(self.engine, calls, 1, (self.policy_sha(), 0), None, (0, 1))
