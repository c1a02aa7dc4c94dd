"""A step's books: each token's count and interval, refunds, and tokens
taken but not spent.

The scheduler's hook takes each user's tokens for the step from the store in
one call (`take_upto`, as many as it has running requests) and records each
charged token here (`charge`): one on its label's counter, and the time since
the request's last token in its label's interval histogram. After stock's
`schedule()` the `Ledger` refunds what was charged but not scheduled (the one
refund point: the count and the interval are taken back) and gives back the
tokens taken and not spent (`fold`). Counters are exact at every step, so
`/metrics` lags only by the publisher's interval. Plain Python: no vLLM
import.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from outrate.budget.store import BudgetStore
from outrate.observe.metrics import BUCKETS_NS, Metrics
from outrate.policy.compiler import CompiledPolicy
from vllm_integration.step.recorder import StepRecorder
from vllm_integration.step.state import ATTR, RequestState, StepScratch, UserState, is_held

if TYPE_CHECKING:
    from vllm_integration.step.lending import Lending
    from vllm_integration.step.prompts import PromptPacer


class Ledger:
    def __init__(
        self, limiter: BudgetStore, metrics: Metrics, recorder: StepRecorder | None = None
    ) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.recorder = recorder  # with --outrate-trace
        self.lending: Lending | None = None  # set by the scheduler: borrowed refunds
        self.prompts: PromptPacer | None = None  # set by the scheduler: prompt refunds
        self.now = -1  # this step's time (-1: no step yet)
        self.prev_now = -1  # the step before's
        self.period = 0  # their difference: a consecutive token's interval
        self.period_slot = 0  # ... and its bucket in every interval histogram

    def begin(self, now: int) -> None:
        """A step starts at `now`. Most tokens' requests had a token in the
        step before, so their interval is the period between the two steps:
        its bucket is found once per step, not once per token."""
        self.prev_now = self.now
        self.now = now
        self.period = now - self.prev_now
        self.period_slot = bisect_left(BUCKETS_NS, self.period)

    def charge(self, rs: RequestState, u: UserState, now: int) -> None:
        """A token charged at step time `now`: counted on the user's label,
        and its interval since the request's last token observed (a token
        after a hold or a preemption has the wait in its interval)."""
        m = u.m
        m.tokens += 1
        last = rs.last_ns
        if last == self.prev_now:  # its last token was in the step before
            h = m.interval
            h.buckets[self.period_slot] += 1
            h.sum_ns += self.period
        elif last:
            m.interval.observe(now - last)
        rs.prev_ns = last
        rs.last_ns = now

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
        if self.prompts is not None:
            self.prompts.refund(r, step, now)
        rs = r.__dict__.get(ATTR)
        if rs is None or rs.charged_step != step:
            return  # refunded already (the last charged, preempted too), or finished
        u = rs.user
        m = u.m
        if rs.over_step == step:
            m.shadow_over -= 1  # a shadow over-limit token: nothing was taken
        elif rs.borrowed_step == step and self.lending is not None:
            self.limiter.give_back_borrowed(u.bucket, now)  # to the excess bucket alone
            self.lending.refunded(rs, u)
            rs.borrowed_step = -1
        elif u.bucket.limit.scale:
            self.limiter.give_back(u.bucket, now)  # at once: a refused user may wait on it
        m.tokens -= 1
        prev = rs.prev_ns
        if prev:  # the token was never sampled: its interval is taken back
            m.interval.unobserve(rs.last_ns - prev)
        rs.last_ns = prev
        rs.charged_step = -1  # not charged this step (nor refunded twice)
        if self.recorder is not None:
            self.recorder.refunded(u.key)
        self.metrics.refunded += 1

    def shadow_over(self, rs: RequestState, u: UserState, step: int, now: int) -> bool:
        """A shadow limit refused a token: count it, let it run. Within the
        rule's peak it counts as what would have been borrowed (`borrowed`),
        beyond it as what the limit would have refused (`shadow_over`)."""
        if u.bucket.limit.excess is not None and self.limiter.borrow(u.bucket, now):
            rs.borrowed_step = step
            if self.lending is not None:
                self.lending.charged(rs, u)
            return True
        rs.over_step = step
        u.m.shadow_over += 1
        return True

    def fold(self, st: StepScratch, now: int) -> None:
        """The step's end: tokens a user was granted and did not spend go back
        to the store (a refused user has none: it was refused with none left,
        and refunds give back at once, so the wake-ups armed before this read
        its final state)."""
        if not st.users:
            return
        give_back = self.limiter.give_back
        for u in st.users:
            if u.left:
                give_back(u.bucket, now, u.left)
                u.left = 0
        st.users.clear()

    def relabel(self, u: UserState, policy: CompiledPolicy) -> None:
        """A reload can move a user to another `limit` label: its live, held
        and prompt-waiting requests move with it (what was counted stays
        counted)."""
        new = self.metrics.record(self.metrics.label_of(u.key, policy))
        old = u.m
        if new is old:
            return
        old.live -= u.live
        new.live += u.live
        old.prompt_waiting -= u.n_prompt_waiting
        new.prompt_waiting += u.n_prompt_waiting
        for r in {e[2] for e in u.held if is_held(e[2])}:  # a request may have stale twins
            since = r.__dict__[ATTR].held_since
            old.held -= 1
            old.held_since_sum -= since
            new.hold(since)
        u.m = new
