"""A step's books: refunds, metrics and the trace.

The scheduler's hook takes each user's tokens for the step from the store in
one call (`take_upto`, as many as it has running requests), counts each token
on the user (`UserState.tokens`) and notes refund candidates in the step's
`StepScratch`. After stock's `schedule()` the `Ledger` refunds what was
charged but not scheduled (the one refund point), gives back the tokens taken
and not spent, and writes one trace line.

Label metrics touch no label record per user and step in steady decode. A
user's token count goes into its label's counter at checkpoints, every
`FLUSH_NS` of engine time (`checkpoint`, from `fold`), and when its last
request finishes. A request's tokens in consecutive steps form a run; every
token of a run after its first has its step's period as interval, so a run's
intervals follow from its first and last step: their sum is the difference
of the two steps' start times, their buckets those of the periods of the
steps between (both kept in rings, one entry per step). A run goes into its
label's histogram when it ends (the request's next token comes after a gap,
or the request finishes) and, while it lasts, at checkpoints. The first
token of a run has its interval observed at once (`gap`). Plain Python: no
vLLM import.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from outrate.budget.store import BudgetStore
from outrate.observe.metrics import BUCKETS_NS, Metrics
from outrate.policy.compiler import CompiledPolicy
from vllm_integration.holdback import Holdback
from vllm_integration.state import ATTR, RequestState, StepScratch, UserState, is_held

RING = 1 << 16
"""Steps whose start times and interval buckets the Ledger remembers: the
intervals of a run, and of a token after a gap of fewer steps, are looked
up, not stored per token."""
MASK = RING - 1

FLUSH_NS = 500_000_000
"""Engine time between checkpoints: how stale a live run's intervals may be
in the histograms (the publisher writes every 0.5 s). Checkpoints also come
every RING // 2 steps, so a run's steps never leave the rings."""


class Ledger:
    def __init__(self, limiter: BudgetStore, metrics: Metrics, stats: dict[str, int]) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.stats = stats
        self.trace: Any = None  # a TraceWriter with --outrate-trace
        self.trace_refunded: dict[str, int] = {}  # this step's refunds per user, while tracing
        self.prev_now = 0  # the previous step's time: consecutive tokens' interval
        self.times = array("q", bytes(8 * RING))  # step k's start time at [k & MASK]
        self.slots = bytearray(RING)  # step k's period's histogram bucket at [k & MASK]
        self.flushed_ns = 0  # the last checkpoint's time
        self.flushed_step = 0  # ... and step

    def begin(self, step: int, now: int) -> None:
        """Step `step` starts at `now`: its time and its period's bucket
        (the interval of every token in it whose request had one the step
        before)."""
        self.times[step & MASK] = now
        self.slots[step & MASK] = bisect_left(BUCKETS_NS, now - self.prev_now)
        self.prev_now = now

    def refund_missed(
        self, st: StepScratch, scheduled: dict[str, int], step: int, now: int
    ) -> None:
        """Charged but not scheduled (KV allocation failed, or preempted later in
        the same step): give the token back. O(1): see StepScratch."""
        r = st.last_charge
        if r is not None:
            st.last_charge = None
            if r.request_id not in scheduled:
                self._refund(r, step, now)
        candidates = st.preempted_charged
        if candidates:
            for r in candidates:
                if r.request_id not in scheduled:
                    self._refund(r, step, now)
            candidates.clear()

    def _refund(self, r: Any, step: int, now: int) -> None:
        rs = r.__dict__.get(ATTR)
        if rs is None or rs.charged_step != step:
            return  # refunded already (the last charged, preempted too), or finished
        u = rs.user
        if rs.over_step == step:
            u.m.shadow_over -= 1  # a shadow over-limit token: nothing was taken
        elif u.bucket.limit.scale:
            self.limiter.give_back(u.bucket, now)  # at once: a refused user may wait on it
        u.tokens -= 1
        if self.trace is not None:
            self.trace_refunded[u.key] = self.trace_refunded.get(u.key, 0) + 1
        self._unobserve(rs, u, step, now)  # and the request's last token is the one before
        self.stats["refunded"] += 1

    @staticmethod
    def shadow_over(rs: RequestState, u: UserState, step: int) -> bool:
        """A shadow limit refused a token: count it, let it run."""
        rs.over_step = step
        u.m.shadow_over += 1
        return True

    def gap(self, rs: RequestState, u: UserState, last: int, step: int, now: int) -> None:
        """A token of a request not charged in the step before (its first, or
        its first after a hold, a preemption or a skipped step): the run that
        ended at `last` goes into the histogram, a new one starts here, and
        this token's interval since the request's last token is observed now."""
        self.flush(rs, last)
        rs.flushed = rs.gap_step = step
        rs.prev_step = last
        if last >= 0:
            t = self._time_of(rs, last, step)
            if t:
                u.m.interval.observe(now - t)

    def flush(self, rs: RequestState, upto: int) -> None:
        """The intervals of the request's run from its last flush to step
        `upto` (its last token, or an earlier one of the same run) into its
        label's histogram: each is its step's period."""
        f = rs.flushed
        n = upto - f
        if n <= 0:
            return
        rs.flushed = upto
        h = rs.user.m.interval
        times = self.times
        h.sum_ns += times[upto & MASK] - times[f & MASK]
        buckets = h.buckets
        if n == 1:
            buckets[self.slots[upto & MASK]] += 1
            return
        a, b = (f + 1) & MASK, (upto & MASK) + 1
        seg = self.slots[a:b] if a < b else self.slots[a:] + self.slots[:b]
        first = seg[0]
        same = seg.count(first)
        buckets[first] += same
        if same != n:  # periods in more than one bucket: rare when steps are steady
            for s in set(seg):
                if s != first:
                    buckets[s] += seg.count(s)

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
        """A refunded token was never sampled: its interval is taken back and
        the request's last token is the one before it again."""
        if rs.gap_step != step:  # in its run: the run ends a step earlier
            rs.charged_step = step - 1
        else:  # the first of a new run: the run before is its run again (flushed)
            last = rs.charged_step = rs.flushed = rs.prev_step
            rs.gap_step = -1
            if last >= 0:
                t = self._time_of(rs, last, step)
                if t:
                    u.m.interval.unobserve(now - t)
        self.stopped(rs, step)  # preempted, most likely: pinned at its last token

    def fold(
        self,
        st: StepScratch,
        step: int,
        now: int,
        requests: Iterable[Any],
        users: Iterable[UserState],
    ) -> None:
        """The step's end: tokens a user was granted and did not spend go back
        to the store (a refused user has none: it was refused with none left,
        and refunds give back at once, so the wake-ups armed before this read
        its final state); a checkpoint when one is due (`requests`, `users`:
        the scheduler's live ones)."""
        if st.users:
            self.give_back_unspent(st, now)
        if now - self.flushed_ns >= FLUSH_NS or step - self.flushed_step >= RING >> 1:
            self.checkpoint(requests, users, step, now)

    def give_back_unspent(self, st: StepScratch, now: int) -> None:
        """Tokens the users granted more than one this step did not spend."""
        give_back = self.limiter.give_back
        for u in st.users:
            if u.left:
                give_back(u.bucket, now, u.left)
                u.left = 0
        st.users.clear()

    def checkpoint(
        self, requests: Iterable[Any], users: Iterable[UserState], step: int, now: int
    ) -> None:
        """Every live user's tokens into its label's counter, and every live
        request's run so far into the histograms (flushed to its last token):
        O(live requests), every FLUSH_NS."""
        self.flushed_ns = now
        self.flushed_step = step
        for u in users:
            if u.tokens:
                u.settle_tokens()
        flush = self.flush
        for r in requests:
            rs = r.__dict__.get(ATTR)
            if rs is not None and rs.charged_step > rs.flushed:
                flush(rs, rs.charged_step)

    def trace_step(
        self,
        scheduled: dict[str, int],
        requests: dict[str, Any],
        step: int,
        now: int,
        holdback: Holdback,
    ) -> None:
        """One trace line: per user id, tokens charged this step (gross),
        refunded and shadow over-limit; held and released. Only while tracing:
        O(requests scheduled)."""
        charged: dict[str, int] = {}
        over: dict[str, int] = {}
        for rid in scheduled:
            rs = requests[rid].__dict__.get(ATTR)
            if rs is None or rs.charged_step != step:
                continue
            key = rs.user.key
            charged[key] = charged.get(key, 0) + 1
            if rs.over_step == step:
                over[key] = over.get(key, 0) + 1
        refunded = self.trace_refunded
        for key, n in refunded.items():
            charged[key] = charged.get(key, 0) + n
        held, released = holdback.trace_held or {}, holdback.trace_released or {}
        if charged or held or released:  # (the writer keeps the dicts: new ones after)
            self.trace.step((now, step, charged, refunded, held, released, over))
            holdback.trace_held = {}
            holdback.trace_released = {}
            self.trace_refunded = {}

    def relabel(self, u: UserState, policy: CompiledPolicy) -> None:
        """A reload can move a user to another `limit` label: its live and
        held requests move with it (counters already counted stay; the
        scheduler checkpoints live runs first)."""
        new = self.metrics.record(self.metrics.label_of(u.key, policy))
        old = u.m
        if new is old:
            return
        u.settle_tokens()  # charged under the old one
        old.live -= u.live
        new.live += u.live
        for r in {e[2] for e in u.held if is_held(e[2])}:  # a request may have stale twins
            since = r.__dict__[ATTR].held_since
            old.held -= 1
            old.held_since_sum -= since
            new.hold(since)
        u.m = new
