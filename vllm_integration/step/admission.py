"""Admission of waiting requests under per-user budgets: whether a request
stock vLLM is about to admit waits instead (deferred), and which held request
gives its slot to a waiting user with budget (fair displacement).

Plain Python over the scheduler's records (state.py) and the `BudgetStore`:
no vLLM import. The scheduler (scheduler.py) calls `admit` from stock's
waiting loop, `parks` once per user with a deferred waiting request at a
step's start (parking.py) and `displacement` once per step; it does the
preempting and the parking.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from outrate.budget.limiter import Limit
from outrate.budget.store import BudgetStore
from outrate.observe.metrics import Metrics
from vllm_integration.step.holdback import Holdback
from vllm_integration.step.state import (
    ATTR,
    RequestState,
    StepScratch,
    UserState,
    end_prompt_wait,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_integration.step.lending import Lending
    from vllm_integration.step.prompts import PromptPacer


class Admission:
    def __init__(
        self,
        limiter: BudgetStore,
        metrics: Metrics,
        holdback: Holdback,
        st: StepScratch,
        chunked: bool,
        caching: bool,
        block_size: int,
    ) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.holdback = holdback
        self.st = st  # the scheduler's step scratch: what a step carries to its end
        self.chunked = chunked  # chunked prefill: a throttled request can prefill ahead
        self.caching = caching  # prefix caching
        self.block_size = block_size
        self.lending: Lending | None = None  # set by the scheduler: borrowers' new prompts
        self.prompts: PromptPacer | None = None  # set while the policy limits prompts

    def admit(
        self,
        request: Request,
        step: int,
        now: int,
        running: int,
        max_active: int,
    ) -> bool:
        """Whether stock may admit `request` now (it would): not while its user
        is at `max_streams`, nor while the user is out of budget, unless it can
        prefill ahead without sampling and a seat stays free for users with
        budget. An admitted request counts as resident at once, so
        `max_streams` holds within one step (`st.admits`: undone after the
        step if stock did not admit it after all)."""
        st = self.st
        rs: RequestState = request.__dict__[ATTR]
        if rs.preempted_step == step:
            return False  # displaced or preempted this step: not back in the same step
        u = rs.user
        limiter = self.limiter
        limit = limiter.limit_of(u.bucket, now)
        if limit.shadow:
            pass  # computed and counted, never enforced
        elif _at_max_streams(u, limit):
            return self._defer(rs, "max_streams")  # waits without blocking anyone else
        elif self.prompts is not None and not self.prompts.can_start(request, rs, step, now):
            return self._defer(rs, "prompt", False)  # no prompt budget for a first chunk
        elif self._out_of_budget(u, step, now):
            lending = self.lending
            if lending is not None and limit.excess is not None:
                # A user with a peak, over its rate: its new prompts come in
                # only on spare capacity (lending.py), never to prefill ahead
                # in a slot a committed newcomer may need.
                if not lending.admit(rs, request, now):
                    return self._defer(rs, "budget", False)
            elif _no_free_seat(running, max_active) or not self.can_prefill_ahead(request):
                st.blocked_until(limiter.ready_at(u.bucket, now))
                return self._defer(rs, "budget")
        rs.deferred = ""
        if rs.prompt_waiting:
            end_prompt_wait(rs)  # admitted: its first chunk is charged in this step
        rs.resident = True
        u.resident += 1
        st.admits.append(request)
        return True

    def parks(self, u: UserState, step: int, now: int, running: int, max_active: int) -> str:
        """Why `admit` would defer every waiting request of `u` in step
        `step`, starting now with `running` visible requests of `max_active`
        (stock's waiting loop only adds to them): "max_streams", or "budget"
        (out of it, no seat free to prefill ahead in, no peak to borrow by);
        "" when one of them may be admitted, or is judged on its own (a
        prompt budget, a peak). `admit`'s own tests, asked once per user: the
        scheduler parks `u`'s requests deferred for that reason for the
        step (parking.py)."""
        limit = self.limiter.limit_of(u.bucket, now)
        if limit.shadow:
            return ""
        if _at_max_streams(u, limit):
            return "max_streams"
        if limit.excess is not None and self.lending is not None:
            return ""
        if self.prompts is not None and self.prompts.paces(u, now):
            return ""
        if _no_free_seat(running, max_active) and self._out_of_budget(u, step, now):
            return "budget"
        return ""

    def _out_of_budget(self, u: UserState, step: int, now: int) -> bool:
        """`u` may not start a request this step: refused a token in it,
        holding held requests (they come back first), or with no token left
        (`u.left`: taken for this step and not spent yet, budget too)."""
        return (
            u.refused_step == step
            or bool(u.n_held)
            or not (u.left or self.limiter.available(u.bucket, now))
        )

    @staticmethod
    def undo_unadmitted(admits: list[Request], running_status: object) -> None:
        """After a step: requests counted resident by `admit` that stock did
        not admit after all (a later check of its own failed) are not."""
        for r in admits:
            rs = r.__dict__.get(ATTR)
            if rs is not None and rs.resident and r.status != running_status:
                rs.resident = False
                rs.user.resident -= 1
        admits.clear()

    def refuse(
        self,
        request: Request,
        rs: RequestState,
        u: UserState,
        step: int,
        num_computed: int,
    ) -> int:
        """The charging hook's answer for a request out of budget: prefill up
        to the last prompt position, sample later (held after the step, most
        likely, if it holds a slot)."""
        st = self.st
        if u.refused_step != step:
            u.refused_step = step
            st.touched.append(u)
        last_prompt = len(request._all_token_ids) - 1
        if self.chunked and num_computed < last_prompt:
            return last_prompt - num_computed
        if rs.resident:
            st.refused.append(request)
        return 0

    def _defer(self, rs: RequestState, reason: str, parks: bool = True) -> bool:
        """Admission deferred; counted once per deferral, not per step.
        `parks`: for a reason `parks` may give (the next step looks for
        requests to park only after one with such deferrals)."""
        if parks:
            self.st.deferrals += 1
        if rs.deferred != reason:
            rs.deferred = reason
            self.metrics.deferred[reason] += 1
            if reason != "prompt" and rs.prompt_waiting:
                end_prompt_wait(rs)  # waits for something else now
        return False

    def can_prefill_ahead(self, request: Request) -> bool:
        """Whether a throttled request can be admitted to prefill without
        sampling. (The caller also keeps the last free seat for users with
        budget.) Stock stops admitting everyone when the lookahead hook
        returns 0 in the waiting loop, so admit only when the cap
        `num_tokens - 1 - computed` is positive whatever the prefix-cache hit
        (hits are whole blocks of at most `num_tokens - 1` tokens)."""
        if not self.chunked or request.num_computed_tokens:
            return False
        n = request.num_tokens
        if n < 2:
            return False
        return not self.caching or (n - 1) % self.block_size != 0

    def displacement(self, users: Iterable[UserState], step: int, now: int) -> Request | None:
        """Fair admission, when every resident slot is taken: the held request
        a waiting user with budget displaces (the youngest held of the user
        holding the most slots), or None. The candidate is the user with
        requests waiting, none held and budget left, below its `max_streams`,
        that holds the fewest slots, wherever its requests stand in the
        queue: at most one displacement per step, none when slots are
        already shared fairly."""
        limiter = self.limiter
        users = list(users)
        best: UserState | None = None
        for u in users:
            if u.live <= u.resident or u.n_held or u.refused_step == step:
                continue
            if best is not None and u.resident >= best.resident:
                continue
            ms = limiter.limit_of(u.bucket, now).max_streams
            if ms is not None and u.resident >= ms:
                continue
            if limiter.available(u.bucket, now) == 0:
                continue
            best = u
        return None if best is None else self.holdback.displacement_victim(best, users)


def _at_max_streams(u: UserState, limit: Limit) -> bool:
    return limit.max_streams is not None and u.resident >= limit.max_streams


def _no_free_seat(running: int, max_active: int) -> bool:
    """No seat for a request out of budget to prefill ahead in: the last
    free one is kept for users with budget."""
    return running + 1 >= max_active
