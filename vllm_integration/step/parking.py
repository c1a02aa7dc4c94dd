"""Parking: for the length of one `schedule()`, the waiting requests whose
user can admit none of them are out of the queue stock walks.

Admission (admission.py) defers a waiting request whose user is at its
`max_streams`, or out of budget while no seat is free to prefill ahead in.
Such a request stays in vLLM's waiting queue, and stock's waiting loop used
to visit it again every step: the hook, then stock's skip and requeue, ~2 us
each here. A user with many requests queued (oos-hog's 36) made every step
dearer for everyone: `schedule()` 116-120 us a step (median, the simulator
on oos-hog) against 35-36 us with the hog at 12 streams; parked, 51-57 us.

At a step's start `Admission.parks` is asked once per user with a deferred
waiting request, and the requests admission last deferred for the reason
it gives are taken out; after stock's `schedule()` they go back where they
were (what stock prepended during the step, a preempted request, stays
first: stock adds nothing else to the queue inside `schedule()`). Nothing else
changes: admission would have deferred each of them again, for the same
reason (a reason that changes is seen by admission first), so the counts,
the queue's order and what is admitted are stock's and admission's own.

What it costs instead: one pass over the queue to take them out and one
to put them back, only in a step after one that deferred or parked any
(`StepScratch.deferrals`). Plain Python over vLLM's `RequestQueue` API and
the scheduler's records: no vLLM import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_integration.step.state import ATTR, StepScratch, UserState

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_integration.step.admission import Admission


class Parking:
    def __init__(self, admission: Admission, st: StepScratch) -> None:
        self.admission = admission
        self.st = st
        self.parked: set[Request] = set()  # out of the queue for this `schedule()`
        self._before: list[Request] = []  # the queue as it was, in its order

    def __len__(self) -> int:
        return len(self.parked)

    def park(self, waiting: Any, step: int, now: int, running: int, active: int) -> int:
        """Take out of `waiting` the requests admission would defer again
        this step (`step`, at `now`, `running` visible requests of `active`):
        those deferred for the reason `Admission.parks` gives their user
        now. A user out of budget says when it is ready, as admission does
        where stock's loop runs (the engine's idle wait after a step that
        ran nothing). Returns how many."""
        st = self.st
        why: dict[UserState, str] = {}
        parked = self.parked
        before = list(waiting)
        for r in before:
            rs = r.__dict__.get(ATTR)
            if rs is None or not rs.deferred or rs.preempted_step == step:
                continue
            u = rs.user
            reason = why.get(u)
            if reason is None:
                reason = why[u] = self.admission.parks(u, step, now, running, active)
                if reason == "budget" and running < active:  # stock's loop would reach it
                    st.blocked_until(self.admission.limiter.ready_at(u.bucket, now))
            if reason and reason == rs.deferred:
                parked.add(r)
        if parked:
            waiting.remove_requests(parked)
            self._before = before
        return len(parked)

    def unpark(self, waiting: Any, fcfs: bool) -> None:
        """Every parked request back where it was: after what stock put at
        the queue's front during the step (a preempted request), among the
        rest in the queue's order before it (FCFS); under PRIORITY, vLLM's
        queue orders them itself."""
        parked = self.parked
        if fcfs:
            after = [waiting.pop_request() for _ in range(len(waiting))]
            before = set(self._before)
            stayed = set(after)
            order = [r for r in after if r not in before]  # stock's additions: at its front
            order += [r for r in self._before if r in parked or r in stayed]
        else:
            order = list(parked)
        for r in order:
            waiting.add_request(r)
        parked.clear()
        self._before = []
