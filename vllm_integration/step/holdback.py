"""Holdback: running requests parked outside vLLM's `running` list while their
user is out of budget, and the wake-ups that bring them back.

A held request keeps its KV blocks and its resident slot; vLLM's loops never
visit it, so a step's cost does not grow with the number of throttled
requests. Per user, held requests sit in a heap (priority, seq): the oldest
held comes back first, so a user's streams rotate. Users with held requests
sit in one wake heap keyed by their GCRA ready time; entries go stale instead
of being removed (checked with `UserState.wakes_at` / `is_held`).

Plain Python over the scheduler's records (state.py): no vLLM import, unit
tested without vLLM (tests/test_holdback.py). The scheduler decides *when* to
hold, release or pick a victim; this class keeps the books.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING

from outrate.budget.store import BudgetStore
from outrate.observe.metrics import Metrics
from vllm_integration.step.recorder import StepRecorder
from vllm_integration.step.state import ATTR, RequestState, UserState, is_held

if TYPE_CHECKING:
    from vllm.v1.request import Request


class Holdback:
    def __init__(
        self,
        limiter: BudgetStore,
        priority: bool,
        metrics: Metrics,
        recorder: StepRecorder | None = None,
    ) -> None:
        self.limiter = limiter
        self.priority = priority  # vLLM's PRIORITY scheduling policy
        self.metrics = metrics
        self.recorder = recorder  # with --outrate-trace
        self.held: dict[Request, None] = {}  # insertion-ordered: newest held last
        self.wake: list[tuple[int, int, UserState]] = []  # (ready_at, seq, user)
        self.seq = 0

    def __len__(self) -> int:
        return len(self.held)

    def __bool__(self) -> bool:
        return bool(self.held)

    # -- holding -------------------------------------------------------------

    def hold(self, r: Request, now: int) -> None:
        rs: RequestState = r.__dict__[ATTR]
        rs.held = True
        rs.held_since = now
        self.held[r] = None
        self.seq += 1
        u = rs.user
        heapq.heappush(u.held, (r.priority if self.priority else 0, self.seq, r))
        u.n_held += 1
        u.m.hold(now)
        self.metrics.holds += 1
        if self.recorder is not None:
            self.recorder.held(u.key)

    def hold_refused(
        self,
        refused: list[Request],
        scheduled: dict[str, int],
        now: int,
        running_status: object,
    ) -> dict[Request, None]:
        """After a step: hold the running requests refused a token that stock
        did not schedule after all, in the order they were refused (held
        streams rotate deterministically). Returns them: the caller takes
        them out of `running`."""
        hold = dict.fromkeys(
            r for r in refused if r.status == running_status and r.request_id not in scheduled
        )
        refused.clear()
        for r in hold:
            self.hold(r, now)
        return hold

    def leave(self, rs: RequestState, r: Request, now: int) -> None:
        """A held request finishes or is preempted: it is no longer held (its
        heap entry is skipped lazily)."""
        rs.held = False
        del self.held[r]
        rs.user.n_held -= 1
        rs.user.m.unhold(rs.held_since, now)

    # -- waking --------------------------------------------------------------

    def arm(self, u: UserState, now: int) -> None:
        """Wake `u` at its ready time."""
        u.ready_at = self.limiter.ready_at(u.bucket, now)
        u.armed = True
        self.seq += 1
        heapq.heappush(self.wake, (u.ready_at, self.seq, u))

    def arm_touched(self, touched: list[UserState], now: int) -> None:
        """Users refused or released this step: wake those still holding requests."""
        for u in touched:
            if u.n_held and not u.armed:
                self.arm(u, now)
        touched.clear()

    def rearm(self, users: Iterable[UserState], now: int) -> None:
        """After a policy swap every ready time may have moved."""
        self.wake.clear()
        for u in users:
            u.armed = False
            if u.n_held:
                self.arm(u, now)

    def release_ready(self, now: int, room: int, running: list[Request]) -> list[UserState]:
        """Put back users whose budget returned, as many streams as they can
        use now and `room` allows. Returns the users still holding requests
        (to be re-armed after the step)."""
        wake = self.wake
        rearm: list[UserState] = []
        while wake and wake[0][0] <= now and room > 0:
            ready, _, u = heapq.heappop(wake)
            if not u.wakes_at(ready):
                continue  # stale entry
            u.armed = False
            if not u.n_held:
                continue
            k = min(self.limiter.available(u.bucket, now), room)
            if k == 0:  # policy changed under it: arm again
                self.arm(u, now)
                continue
            room -= self.release_user(u, k, now, running)
            if u.n_held:
                rearm.append(u)
        return rearm

    def release_user(self, u: UserState, k: int, now: int, running: list[Request]) -> int:
        """Up to `k` of `u`'s held requests back into `running`, oldest first."""
        released = 0
        heap = u.held
        while heap and released < k:
            r = heapq.heappop(heap)[2]
            if not is_held(r):
                continue  # finished or preempted while held
            rs = r.__dict__[ATTR]
            rs.held = False
            u.m.unhold(rs.held_since, now)
            del self.held[r]
            u.n_held -= 1
            running.append(r)
            released += 1
        self.metrics.releases += released
        if released and self.recorder is not None:
            self.recorder.released(u.key, released)
        return released

    def release_all(self, users: Iterable[UserState], now: int, running: list[Request]) -> None:
        for u in users:
            if u.n_held:
                self.release_user(u, u.n_held, now, running)
            u.armed = False
        self.wake.clear()

    def earliest_ready(self, blocked: int = 0) -> int:
        """The earliest live wake-up time, or `blocked` (the ready time of a
        user whose waiting request admission deferred) if that is earlier;
        0: none. Drops stale heads."""
        wake = self.wake
        while wake:
            ready, _, u = wake[0]
            if u.wakes_at(ready):
                return blocked if blocked and blocked < ready else ready
            heapq.heappop(wake)
        return blocked

    # -- victims -------------------------------------------------------------

    def kv_victim(self, running: list[Request]) -> Request | None:
        """Which held request to preempt when KV runs out: the most recently
        held (FCFS), or the lowest-priority held one unless a visible request
        has lower priority still (PRIORITY: stock would preempt that one)."""
        if not self.priority:
            return next(reversed(self.held))
        victim = max(self.held, key=lambda r: (r.priority, r.arrival_time))
        if running and victim.priority < max(r.priority for r in running):
            return None
        return victim

    def displacement_victim(
        self, newcomer: UserState, users: Iterable[UserState]
    ) -> Request | None:
        """Fair admission: the youngest held request of the user holding the
        most slots, if it holds at least two more than `newcomer`."""
        victim_user = max((v for v in users if v.n_held), key=lambda v: v.resident, default=None)
        if victim_user is None or victim_user.resident <= newcomer.resident + 1:
            return None
        return self.youngest_held(victim_user)

    @staticmethod
    def youngest_held(u: UserState) -> Request:
        return max((e for e in u.held if is_held(e[2])), key=lambda e: (e[0], e[1]))[2]
