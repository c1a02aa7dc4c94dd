"""The end of a step's books: refunds, metrics and the trace.

The scheduler's hook takes each user's tokens for the step from the store in
one call (`take_upto`, as many as it has running requests), counts each
charge on the user (`UserState.st_*`) and notes refund candidates in the
step's `StepScratch`; after stock's `schedule()` the `Ledger` refunds what was
charged but not scheduled (the one refund point), then folds the step into
each label's metrics, gives back the tokens taken and not spent, and writes
one trace line. Plain Python: no vLLM import.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from typing import Any

from outrate.compiler import CompiledPolicy
from outrate.metrics import BUCKETS_NS, Metrics
from outrate.store import BudgetStore
from vllm_integration.holdback import Holdback
from vllm_integration.state import ATTR, RequestState, StepScratch, UserState, is_held

RING = 1 << 16
"""Steps whose start times the Ledger remembers (512 KiB): the interval of a
token after a gap of fewer steps is looked up, not stored per token."""
MASK = RING - 1


class Ledger:
    def __init__(self, limiter: BudgetStore, metrics: Metrics, stats: dict[str, int]) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.stats = stats
        self.trace: Any = None  # a TraceWriter with --outrate-trace
        self.prev_now = 0  # the previous step's time: consecutive tokens' interval
        self.times = array("q", bytes(8 * RING))  # step k's time at [k & MASK] (fold)

    def refund_missed(
        self, st: StepScratch, scheduled: dict[str, int], step: int, now: int
    ) -> None:
        """Charged but not scheduled (KV allocation failed, or preempted later in
        the same step): give the token back. O(1): see StepScratch."""
        refunded = 0
        candidates = st.preempted_charged
        for r in (st.last_charge_running, st.last_charge_waiting, *candidates):
            if r is None or r.request_id in scheduled:
                continue
            rs = r.__dict__.get(ATTR)
            if rs is None or rs.charged_step != step:
                continue
            u = rs.user
            if rs.over_step == step:
                u.st_over -= 1  # a shadow over-limit token: nothing was taken
            elif u.bucket.limit.scale:
                self.limiter.give_back(u.bucket, now)  # at once: a refused user may wait on it
            u.st_refunded += 1
            self._unobserve(rs, u, step, now)  # and the request's last token is the one before
            refunded += 1
        self.stats["refunded"] += refunded
        st.last_charge_running = st.last_charge_waiting = None
        candidates.clear()

    @staticmethod
    def shadow_over(rs: RequestState, u: UserState, step: int) -> bool:
        """A shadow limit refused a token: count it, let it run."""
        rs.over_step = step
        u.st_over += 1
        return True

    def gap(self, rs: RequestState, u: UserState, last: int, step: int, now: int) -> None:
        """A token of a request not charged in the step before (its first, or
        its first after a hold, a preemption or a skipped step): counted, and
        its interval since the request's last token observed now (tokens in
        consecutive steps take the step's period, at the fold)."""
        u.st_gap += 1
        rs.gap_step = step
        rs.prev_step = last
        if last >= 0:
            t = self._time_of(rs, last, step)
            if t:
                u.m.interval.observe(now - t)

    def _time_of(self, rs: RequestState, k: int, step: int) -> int:
        """When step `k` (< `step`, the current one) started; 0 if unknown: more
        than RING steps ago and not when the request stopped (`stopped`)."""
        if step - k < RING:
            return self.times[k & MASK]
        return rs.last_ns if rs.last_step == k else 0

    def stopped(self, rs: RequestState, step: int) -> None:
        """A request refused a token or preempted: keep its last token's time
        on it, for a gap longer than the ring. A token of this very step is
        not its last yet: a request preempted after its charge is refunded
        (`_unobserve` pins the token before)."""
        k = rs.charged_step
        if 0 <= k < step and k != rs.last_step:
            rs.last_ns = self._time_of(rs, k, step)
            rs.last_step = k

    def _unobserve(self, rs: RequestState, u: UserState, step: int, now: int) -> None:
        """A refunded token was never sampled: take back its count and its
        interval; the request's last token is the one before it again."""
        if rs.gap_step != step:  # in the step after its last: the period's
            u.st_consec -= 1
            rs.charged_step = step - 1
        else:
            u.st_gap -= 1
            last = rs.charged_step = rs.prev_step
            rs.gap_step = -1
            if last >= 0:
                t = self._time_of(rs, last, step)
                if t:
                    u.m.interval.unobserve(now - t)
        self.stopped(rs, step)  # preempted, most likely: pinned at its last token

    def fold(self, st: StepScratch, step: int, now: int, holdback: Holdback) -> None:
        """This step's charges into each label's metrics, and one trace line.
        Requests charged in the previous step too get this step's period as
        their token interval, observed once per user. Tokens a user was
        granted and did not spend go back to the store here (a refused user
        has none: it was refused with none left, and refunds give back at
        once, so the wake-ups armed before this read its final state)."""
        period = now - self.prev_now
        self.prev_now = now
        self.times[step & MASK] = now
        users = st.users
        trace = self.trace
        if not users and trace is None:
            return
        # The trace's counts, read before the loop below folds and resets them.
        counts = None if trace is None else self._trace_counts(users)
        give_back = self.limiter.give_back
        slot = bisect_left(BUCKETS_NS, period)  # one bucket for every user this step
        total = 0
        for u in users:  # the fewest operations per user: 256 users cost 256 of these
            if u.left:  # taken for this step, not spent: back to the store
                give_back(u.bucket, now, u.left)
                u.left = 0
            consec = u.st_consec
            net = consec + u.st_gap  # net: refunds took theirs back
            total += net
            m = u.m
            m.tokens += net
            if consec:
                h = m.interval  # == h.observe(period, consec)
                h.buckets[slot] += consec
                h.sum_ns += period * consec
            if u.st_over:
                m.shadow_over += u.st_over
                u.st_over = 0
            u.st_consec = u.st_gap = 0  # (st_refunded: read only by the trace, reset there)
        users.clear()
        self.stats["charged"] += total
        if counts is None:
            return
        charged, refunded, over = counts
        held, released = holdback.trace_held or {}, holdback.trace_released or {}
        if charged or held or released:
            trace.step((now, step, charged, refunded, held, released, over))
            holdback.trace_held = {}
            holdback.trace_released = {}

    @staticmethod
    def _trace_counts(
        users: list[UserState],
    ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Per user id: tokens charged this step (gross), refunded, and shadow
        over-limit. Only while tracing (`st_refunded` is reset here alone)."""
        charged: dict[str, int] = {}
        refunded: dict[str, int] = {}
        over: dict[str, int] = {}
        for u in users:
            gross = u.st_consec + u.st_gap + u.st_refunded
            if gross:
                charged[u.key] = gross
            if u.st_refunded:
                refunded[u.key] = u.st_refunded
                u.st_refunded = 0
            if u.st_over:
                over[u.key] = u.st_over
        return charged, refunded, over

    def relabel(self, u: UserState, policy: CompiledPolicy) -> None:
        """A reload can move a user to another `limit` label: its live and
        held requests move with it (counters already counted stay)."""
        new = self.metrics.record(self.metrics.label_of(u.key, policy))
        old = u.m
        if new is old:
            return
        old.live -= u.live
        new.live += u.live
        for r in {e[2] for e in u.held if is_held(e[2])}:  # a request may have stale twins
            since = r.__dict__[ATTR].held_since
            old.held -= 1
            old.held_since_sum -= since
            new.hold(since)
        u.m = new
