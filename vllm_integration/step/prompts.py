"""Prompt pacing: each user's prompt tokens computed, charged chunk by chunk
against a second budget table (docs/prompt-limits.md).

A prompt position is charged once per request, when a step that computes it
is dispatched: prefix-cache hits are never in a chunk, and recomputation after
a preemption (positions below `RequestState.prompt_done`) is free. A chunk is
cut to what the user's prompt budget allows (`pace`); what the output logic
then cuts off goes back (`trim`); the one refund point gives a missed step's
tokens back (`refund`). `dispatch` is the charging hook's whole prompt path,
those steps in order. Admission defers a waiting request whose user has no
prompt budget (`can_start`), so the hook never returns 0 in stock's waiting
loop, which would stop admission for everyone; a running request skipped for
prompt budget gives its active seat to a waiting one.

A prompt `peak` lends as an output peak does (lending.py): positions past the
prompt rate are borrowed from the excess bucket, only within the step time
no committed user needs (`Lending.plan`'s `borrow_tokens`, which output
borrowers' chunks share), or within stock's token budget alone in a step
with no time target (nobody with a committed rate to keep): work conserving.

Plain Python over the scheduler's records (state.py) and a `Limiter` whose
policy is `CompiledPolicy.prompts`: no vLLM import. With a shared store the
table's budgets are shared (vllm_integration/enginecore/store.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import TYPE_CHECKING, Protocol

from outrate.budget.limiter import Limiter
from outrate.observe.metrics import Metrics
from vllm_integration.step.recorder import StepRecorder
from vllm_integration.step.state import (
    ATTR,
    RequestState,
    StepScratch,
    UserState,
    end_prompt_wait,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request


class Host(Protocol):
    """What the pacer needs of the scheduler (scheduler.py's `OutrateMixin`):
    the output charge of a chunk, and stock's caps on seats this step."""

    max_num_active_reqs: int
    max_num_running_reqs: int
    max_num_scheduled_tokens: int
    running: list[Request]

    @property
    def holdback(self) -> Sized: ...

    def _charge(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int: ...


class PromptPacer:
    def __init__(
        self,
        table: Limiter,
        metrics: Metrics,
        st: StepScratch,
        chunked: bool,
        host: Host,
        running: object,
    ) -> None:
        self.table = table  # the prompt budgets (policy: CompiledPolicy.prompts)
        self.metrics = metrics
        self.st = st
        self.chunked = chunked  # chunked prefill: a prompt may be computed over several steps
        self.host = host
        self.running = running  # vLLM's RequestStatus.RUNNING (no vLLM import here)
        self.recorder: StepRecorder | None = None  # with --outrate-trace

    def dispatch(self, request: Request, nc: int, n: int, step: int, now: int) -> int:
        """A chunk `[nc, nc + n)` with prompt positions, under prompt limits:
        a running request's cut to leave every other running request a token
        of the step's budget (the decode reserve: decodes never wait behind a
        prefill, whatever the order of `running`), then to the prompt budget,
        then charged for output as any chunk; what the output logic cuts off
        goes back. A running request with no prompt budget (or no room) is
        skipped (0) and takes no active seat this step: stock's waiting loop
        may admit one more (never above `max_num_seqs` less the held, stock's
        own assert); `schedule()` restores the cap after the step."""
        rs: RequestState = request.__dict__[ATTR]
        host = self.host
        in_running = request.status == self.running  # the running loop (not admission)
        if in_running:
            st = self.st
            room = host.max_num_scheduled_tokens - (len(host.running) - 1) - st.prefill_granted
            if n > room:
                n = room if room > 0 else 0
        if n:
            n = self.pace(request, rs, nc, n, step, now)
        if not n:
            if in_running:
                self.metrics.prompt_skips += 1
                if host.max_num_active_reqs < host.max_num_running_reqs - len(host.holdback):
                    host.max_num_active_reqs += 1
            return 0
        m = host._charge(request, nc, n)
        if m != n:
            self.trim(rs, nc, m, request.num_prompt_tokens, step, now)
        if in_running:
            self.st.prefill_granted += m
        return m

    def pace(self, request: Request, rs: RequestState, nc: int, n: int, step: int, now: int) -> int:
        """The chunk `[nc, nc + n)` cut to what the user's prompt budget
        allows, its chargeable positions taken from the budget. 0: none allowed
        (the caller skips the request; admission kept it out of the waiting
        loop)."""
        p = request.num_prompt_tokens
        start = nc if nc > rs.prompt_done else rs.prompt_done
        end = nc + n if nc + n < p else p
        want = end - start
        if want <= 0:
            return n  # recomputation or output positions: free
        u = rs.user
        pb = u.pbucket
        assert pb is not None  # pinned with the user (roster.py)
        table = self.table
        k = table.take_upto(pb, now, want)
        counted = k
        borrowed = 0
        if k < want:
            lim = table.limit_of(pb, now)
            if lim.shadow:
                counted = want  # computed and counted, never enforced
                u.m.prompt_over += want - k
            else:
                if lim.excess is not None:  # a prompt peak: the rest in spare time
                    u.pshort_step = step
                    borrowed = self._borrow(u, want - k, now)
                    counted += borrowed
                if counted < want:
                    self._blocked(u, now)
                    if not self.chunked and counted:  # the whole prompt or nothing
                        self._give_back(u, k, borrowed, now)
                        k = counted = borrowed = 0
                    if not counted:
                        self._waits(rs)  # none of its next prompt positions this step
                    n = start + counted - nc if self.chunked else 0
        if counted:
            if rs.prompt_waiting:
                end_prompt_wait(rs)
            if rs.prompt_step != step:
                rs.prompt_step = step
                rs.prompt_prev = rs.prompt_done
                rs.prompt_taken = rs.prompt_counted = rs.prompt_borrowed = 0
            rs.prompt_taken += k
            rs.prompt_counted += counted
            rs.prompt_done = start + counted
            u.m.prompt += counted
            if borrowed:
                rs.prompt_borrowed += borrowed
                u.m.prompt_borrowed += borrowed
            self.st.last_charge = request  # a refund candidate (state.py)
        return n

    def _borrow(self, u: UserState, n: int, now: int) -> int:
        """Up to `n` prompt tokens from the excess bucket of `u`'s prompt
        budget (its peak), within the step time no committed user needs
        (`Lending.plan`'s `borrow_tokens`, shared with output borrowers'
        chunks) when the step has a time target; without one, within stock's
        token budget alone. Counted in `u.pserved` (seconds of its prompt
        rate), the order prompt borrowers reach the spare time in
        (`Lending.prompt_order`)."""
        st = self.st
        if st.borrow_timed and st.borrow_tokens < n:
            n = st.borrow_tokens
        if n <= 0:
            return 0
        pb = u.pbucket
        assert pb is not None
        k = self.table.borrow_upto(pb, now, n)
        if st.borrow_timed:
            st.borrow_tokens -= k
        u.pserved += k * pb.limit.token_s
        return k

    def _give_back(self, u: UserState, taken: int, borrowed: int, now: int) -> None:
        """Return prompt tokens to `u`'s budget: `taken` to the committed
        bucket, `borrowed` to the excess bucket, to this step's spare time
        and off its borrowed service."""
        pb = u.pbucket
        assert pb is not None
        if taken:
            self.table.give_back(pb, now, taken)
        if borrowed:
            self.table.give_back_borrowed(pb, now, borrowed)
            u.pserved -= borrowed * pb.limit.token_s
            if self.st.borrow_timed:
                self.st.borrow_tokens += borrowed

    def trim(self, rs: RequestState, nc: int, m: int, p: int, step: int, now: int) -> None:
        """The output logic cut the chunk to `m` tokens: prompt positions
        charged beyond it go back at once. Under a shadow prompt limit the
        last positions counted were the ones over it (`prompt_counted -
        prompt_taken`): those are uncounted first, then the taken ones go
        back to the budget."""
        if rs.prompt_step != step:
            return
        end = nc + m if nc + m < p else p
        floor = end if end > rs.prompt_prev else rs.prompt_prev
        extra = rs.prompt_done - floor
        if extra <= 0:
            return
        u = rs.user
        over = rs.prompt_counted - rs.prompt_taken - rs.prompt_borrowed
        if over > extra:
            over = extra
        lent = extra - over  # borrowed positions were counted after the taken ones
        if lent > rs.prompt_borrowed:
            lent = rs.prompt_borrowed
        back = extra - over - lent
        if back > rs.prompt_taken:
            back = rs.prompt_taken
        self._give_back(u, back, lent, now)
        rs.prompt_taken -= back
        rs.prompt_borrowed -= lent
        rs.prompt_counted -= extra
        rs.prompt_done = floor
        u.m.prompt -= extra
        u.m.prompt_over -= over
        u.m.prompt_borrowed -= lent

    def refund(self, r: Request, step: int, now: int) -> None:
        """`r` was prompt-charged this step and missed it: give it all back."""
        rs = r.__dict__.get(ATTR)
        if rs is None or rs.prompt_step != step:
            return
        u = rs.user
        self._give_back(u, rs.prompt_taken, rs.prompt_borrowed, now)
        u.m.prompt -= rs.prompt_counted
        u.m.prompt_borrowed -= rs.prompt_borrowed
        # shadow: the ones over its limit
        u.m.prompt_over -= rs.prompt_counted - rs.prompt_taken - rs.prompt_borrowed
        rs.prompt_done = rs.prompt_prev
        rs.prompt_step = -1
        self.metrics.prompt_refunded += rs.prompt_counted

    def paces(self, u: UserState, now: int) -> bool:
        """Whether `u`'s prompts wait for a prompt budget (a limit, not in
        shadow): else `can_start` admits all of them."""
        pb = u.pbucket
        if pb is None:
            return False
        lim = self.table.limit_of(pb, now)
        return lim.rate is not None and not lim.shadow

    def can_start(self, request: Request, rs: RequestState, step: int, now: int) -> bool:
        """Whether a waiting request may be admitted now: its user has prompt
        budget for a first chunk (without chunked prefill: for all of its
        prompt not yet charged), committed or, under a prompt peak, borrowed
        in this step's spare time; or it has nothing left to charge."""
        left = request.num_prompt_tokens - rs.prompt_done
        if left <= 0:
            return True
        u = rs.user
        pb = u.pbucket
        assert pb is not None
        table = self.table
        lim = table.limit_of(pb, now)
        if lim.rate is None or lim.shadow:
            return True
        need = (1 if self.chunked else left) - table.available(pb, now)
        if need <= 0:
            return True
        if lim.excess is not None:  # a prompt peak: borrowed, in spare time (`pace`)
            u.pshort_step = step
            st = self.st
            spare = st.borrow_tokens if st.borrow_timed else need
            if spare >= need and table.borrowable(pb, now) >= need:
                return True
        self._blocked(u, now)
        self._waits(rs)
        return False

    def _waits(self, rs: RequestState) -> None:
        """`rs` found no prompt budget for its next position this step (a
        running prefill skipped, a waiting request deferred): a wait starts
        unless one runs (`outrate_prompt_waits_total`, the gauge
        `outrate_prompt_waiting_requests`), and the step's trace line counts
        it (`prompt_waiting`). It ends with `end_prompt_wait` (state.py)."""
        u = rs.user
        if not rs.prompt_waiting:
            rs.prompt_waiting = True
            u.n_prompt_waiting += 1
            m = u.m
            m.prompt_waiting += 1
            m.prompt_waits += 1
        if self.recorder is not None:
            self.recorder.prompt_waited(u.key)

    def stop_waits(self, requests: Iterable[Request]) -> None:
        """Prompts are no longer limited (a reload): nobody waits for prompt
        budget. Once per such reload, O(requests)."""
        for r in requests:
            rs = r.__dict__.get(ATTR)
            if rs is not None:
                end_prompt_wait(rs)

    def _blocked(self, u: UserState, now: int) -> None:
        """The engine's idle wait ends by the time `u` has prompt budget
        again: committed, or under a prompt peak borrowed, whichever comes
        first (the excess bucket refills at `peak - rate`, often sooner)."""
        st = self.st
        pb = u.pbucket
        assert pb is not None
        ready = self.table.ready_at(pb, now)
        lent = self.table.borrow_ready_at(pb, now)
        if lent is not None and lent < ready:
            ready = lent
        st.blocked_until(ready)
