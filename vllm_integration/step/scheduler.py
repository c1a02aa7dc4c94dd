"""The rate-limited vLLM V1 scheduler: a thin adapter over vLLM's
`Scheduler` / `AsyncScheduler` (the overridden methods and why are indexed in
vllm_integration/common/patches.py).

One step, top to bottom (`schedule`): swap in a reloaded policy; release held
requests whose user's budget returned; displace one held request if every
resident slot is taken and a user with budget waits; park the waiting
requests admission would only defer again (parking.py); run stock
`schedule()`, during which the hooks charge each sampling dispatch
(`_reserve_prefill_lookahead`) and defer admissions
(`_handle_blocked_waiting_request`); put the parked back; then settle the step
(`_after_schedule`): refunds, requeue, holds, wake-ups and the trace.

The machinery lives beside it: `Holdback` (holdback.py) parks throttled
running requests outside `running` and wakes them; `Parking` (parking.py)
keeps deferred waiting requests out of stock's waiting loop; `Admission`
(admission.py) defers, displaces and answers a refused charge; `Ledger`
(ledger.py) counts each token and settles refunds and unspent tokens;
`StepRecorder` (recorder.py) collects a step's trace line; `StepScratch`
(state.py) is what one step carries to its end; `wire_engine`
(vllm_integration/enginecore/wiring.py) sets it all up in the engine core
once the scheduler is built, and `swap_policy` applies a reload.
Policy decisions are the core's (`outrate.budget` behind the `BudgetStore`
protocol).

Holdback restores two stock behaviours explicitly: `len(running) + held <=
max_num_seqs` (the admission cap `max_num_active_reqs` is lowered for the
step), and held requests are the preferred preemption victims
(`HeldFirstAllocation`, kv.py, only in steps that start with held requests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.request import Request, RequestStatus

from outrate.budget.gcra import lends
from outrate.budget.limiter import Limiter
from outrate.budget.quota import QuotaBook
from outrate.budget.store import BudgetStore
from outrate.identity.core import Stamper, resolve_identity
from outrate.observe.metrics import Metrics
from outrate.policy.compiler import CompiledPolicy
from vllm_integration.step.admission import Admission
from vllm_integration.step.holdback import Holdback
from vllm_integration.step.kv import HeldFirstAllocation
from vllm_integration.step.ledger import Ledger
from vllm_integration.step.lending import Lending
from vllm_integration.step.parking import Parking
from vllm_integration.step.prompts import PromptPacer
from vllm_integration.step.quotas import FOLD_INTERVAL_NS, QuotaMeter
from vllm_integration.step.recorder import StepRecorder
from vllm_integration.step.roster import Roster
from vllm_integration.step.state import ATTR, PolicyBox, RequestState, StepScratch
from vllm_integration.step.steptime import CostModel, Prior, StepCost

logger = logging.getLogger("vllm.outrate")  # under vLLM's logger: same format and level

IDLE_WAIT_MAX_NS = 50_000_000
"""Longest the engine waits on its input queue when everyone is throttled."""

_RUNNING = RequestStatus.RUNNING


class OutrateMixin:
    """The rate-limiting behaviour, mixed into vLLM's Scheduler classes."""

    # Provided by vLLM's Scheduler (declared for readers and type checkers).
    running: list[Request]
    requests: dict[str, Request]
    max_num_running_reqs: int
    max_num_active_reqs: int
    max_num_scheduled_tokens: int
    waiting: Any
    kv_cache_manager: Any

    outrate_threads: Any = None
    """The engine threads (reload, metrics, trace, leases, quota saves)
    `wire_engine` started: the scheduler stops them with itself."""
    quota: QuotaMeter | None = None
    """With quotas (`--outrate-quota-file`): counts usage into the engine's book."""

    def shutdown(self) -> None:
        if self.outrate_threads is not None:
            self.outrate_threads.stop()
        super().shutdown()  # type: ignore[misc]

    def outrate_configure(
        self,
        policy: CompiledPolicy | PolicyBox,
        clock: Callable[[], int] = time.monotonic_ns,
        limiter: BudgetStore | None = None,
        step_model: CostModel | None = None,
        prompt_table: Limiter | None = None,
    ) -> None:
        """(Re)wire the limiter. The engine calls this once; tests pass a fake
        clock. `limiter`: a shared store (`--outrate-store`) instead of the
        in-memory `Limiter`; `prompt_table`: the prompt budgets' table lent by
        that store (vllm_integration/enginecore/store.py), else one in memory.
        `step_model`: the prior of the step cost the scheduler learns online
        (steptime.py; the simulator passes its own)."""
        self.policy_box = policy if isinstance(policy, PolicyBox) else PolicyBox(policy)
        self._policy = self.policy_box.current  # the one the limiter enforces
        # Verifies the identity the API server signed (identity.source header/api_key).
        self._stamper = Stamper.from_env()
        if limiter is None:
            limiter = Limiter(self._policy, clock=clock)
        self.limiter: BudgetStore = limiter
        self._clock = clock
        self.metrics = Metrics()
        self.recorder: StepRecorder | None = None  # with --outrate-trace (outrate_trace)
        sc = self.scheduler_config  # type: ignore[attr-defined]
        self._priority = self.policy == SchedulingPolicy.PRIORITY  # type: ignore[attr-defined]
        self._st = StepScratch()
        self.holdback = Holdback(self.limiter, self._priority, self.metrics)
        self.ledger = Ledger(self.limiter, self.metrics)
        self.admission = Admission(
            self.limiter,
            self.metrics,
            self.holdback,
            self._st,
            chunked=bool(sc.enable_chunked_prefill),
            caching=bool(self.cache_config.enable_prefix_caching),  # type: ignore[attr-defined]
            block_size=self.block_size,  # type: ignore[attr-defined]
        )
        self.parking = Parking(self.admission, self._st)
        self.lending = Lending(self.limiter, self.metrics, self.holdback, self._st)
        # Borrowing spends only step time no committed user needs: learned while lending runs.
        self.step_cost = self.lending.cost = StepCost(step_model or Prior())
        self.admission.lending = self.ledger.lending = self.lending
        # Prompt budgets: a second table over the rules' prompt limits (prompts.py).
        if prompt_table is None:
            prompt_table = Limiter(self._policy.prompts, clock=clock)
        self.prompt_table = prompt_table
        self.lending.prompts = prompt_table  # who is about to borrow prompt tokens
        chunked = bool(sc.enable_chunked_prefill)
        self.prompts = PromptPacer(
            self.prompt_table, self.metrics, self._st, chunked, self, _RUNNING
        )
        self.ledger.prompts = self.prompts
        self._pace_prompts(self._policy)
        self._lending(self._policy)
        self.roster = Roster(self.limiter, self.metrics, self.prompt_table)
        self._users = self.roster.users  # users with live requests, by id
        self._step = 0
        self._now = 0
        self._cfg_active = self.max_num_active_reqs
        if getattr(self, "num_prefill_lookahead", 0) > 1:  # the hook replaces stock's
            raise ValueError(
                "outrate does not support speculative decoding (it needs vLLM's "
                "prefill lookahead, which outrate's charging hook replaces)"
            )
        self._alloc = HeldFirstAllocation(self)
        self.quota: QuotaMeter | None = None  # with quotas: `outrate_quotas`
        for req in self.requests.values():  # only tests re-wire a scheduler with requests
            self._register(req)

    def outrate_trace(self, trace: Any) -> None:
        """Write a trace line per step to `trace` (a TraceWriter): one
        recorder, handed to the holdback and the ledger."""
        self.recorder = StepRecorder(trace)
        self.holdback.recorder = self.ledger.recorder = self.prompts.recorder = self.recorder

    def outrate_quotas(self, book: QuotaBook) -> None:
        """Count quota usage into `book` (saved by the engine's QuotaSaver).
        Users with usage saved before a restart get their metrics label now,
        as at a first request, so /metrics shows their usage under it."""
        self.quota = QuotaMeter(book, self._policy)
        for user in list(book.users):
            self.metrics.label_of(user, self._policy)

    def swap_policy(self, policy: CompiledPolicy, now: int) -> None:
        """A reloaded policy takes over at the start of a step: the store
        converts each user's debt at `now`, held users are re-armed for
        their new limits, users move to their new `limit` labels, and the
        trace notes it."""
        self._policy = policy
        self.limiter.set_policy(policy, now)
        self.prompt_table.set_policy(policy.prompts, now)
        self._pace_prompts(policy)
        self._lending(policy)
        if self.quota is not None:
            self.quota.set_policy(policy)
        self._st.borrow_timed = False  # the next plan says again
        logger.debug("outrate: scheduler switched to %s", policy.summary())
        users = self._users.values()
        self.holdback.rearm(users, now)
        for u in users:
            self.ledger.relabel(u, policy)
        if self.recorder is not None:
            self.recorder.event(now, policy=policy.sha256, source=policy.source)

    def _lending(self, policy: CompiledPolicy) -> None:
        """Lending runs while some rule has a peak (lending.py). A prompt
        peak plans every step: any running prefill may borrow (prompts.py)."""
        prompt = [lim.prompt for lim in policy.all_limits() if lim.prompt is not None]
        self._plends = self.lending.prompt_peaks = lends(prompt)
        self._lends = self._plends or lends(policy.all_limits())

    def _pace_prompts(self, policy: CompiledPolicy) -> None:
        """Prefill is paced only while some rule limits prompts: without one
        the hook and admission run as before, step by step (and nobody
        waits for prompt budget any more)."""
        was = getattr(self, "_prompts", False)
        self._prompts = bool(policy.prompt_rules)
        self.admission.prompts = self.prompts if self._prompts else None
        if was and not self._prompts:
            self.prompts.stop_waits(self.requests.values())

    @property
    def charged(self) -> int:
        return self.roster.charged()

    @property
    def n_held(self) -> int:
        return len(self.holdback)

    # -- request lifecycle (the user table: roster.py) ---------------------------

    def _register(self, request: Request) -> None:
        source = self.policy_box.current.identity.source  # the newest: trust changes at once
        key = resolve_identity(request.sampling_params, logger, source, self._stamper)
        self.roster.register(request, key, self._policy, request.status == RequestStatus.RUNNING)
        if self.recorder is not None:
            self.recorder.arrived(key)

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            self._register(request)
        super().add_request(request)  # type: ignore[misc]

    def _leave_slot(self, rs: RequestState, request: Request) -> None:
        if rs.borrowing:
            self.lending.stop(request, rs)
        if rs.held:
            self.holdback.leave(rs, request, self._clock())
        if rs.resident:
            rs.resident = False
            rs.user.resident -= 1

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        if self.quota is not None:
            self.quota.count(request)  # its last tokens (quotas.py)
        rs = request.__dict__.pop(ATTR, None)
        if rs is not None:
            self._leave_slot(rs, request)
            self.roster.finish(rs)
        return super()._free_request(request, delay_free_blocks)  # type: ignore[misc]

    def _preempt_request(
        self, request: Request, timestamp: float, drop_stale_output: bool = False
    ) -> None:
        rs = request.__dict__.get(ATTR)
        if rs is not None:
            self._leave_slot(rs, request)
            rs.preempted_step = self._step
            if rs.charged_step == self._step or rs.prompt_step == self._step:
                self._st.preempted_charged.append(request)  # refunded after the step
        super()._preempt_request(request, timestamp, drop_stale_output)  # type: ignore[misc]

    def get_request_counts(self) -> tuple[int, int]:
        running, waiting = super().get_request_counts()  # type: ignore[misc]
        return running + len(self.holdback), waiting + len(self.parking)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        if reset_running_requests:
            self.holdback.release_all(self._users.values(), self._clock(), self.running)
        reset: bool = super().reset_prefix_cache(  # type: ignore[misc]
            reset_running_requests, reset_connector
        )
        return reset

    # -- the hooks inside stock schedule() ----------------------------------

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        if num_new_tokens > 1 and self._st.borrow_timed:  # a chunk, in a step lent by time
            if request._outrate.borrowing and request.status == _RUNNING:  # type: ignore[attr-defined]
                num_new_tokens = self.lending.cut(num_new_tokens)  # its prompt in spare time
        if self._prompts and num_new_tokens and num_computed_tokens < request.num_prompt_tokens:
            n = num_new_tokens  # a chunk with prompt positions (prompts.py)
            return self.prompts.dispatch(request, num_computed_tokens, n, self._step, self._now)
        return self._charge(request, num_computed_tokens, num_new_tokens)

    def _charge(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """The output charge of a dispatch that samples (the seed's rule)."""
        # `_all_token_ids`: request.num_tokens without a property call.
        if num_computed_tokens + num_new_tokens < len(request._all_token_ids) or not num_new_tokens:
            return num_new_tokens  # nothing sampled: middle prefill chunks are free
        rs: RequestState = request._outrate  # type: ignore[attr-defined]  # ATTR, see state.py
        step = self._step
        if rs.charged_step == step:
            return num_new_tokens  # never charge a request twice in a step
        u = rs.user
        left = u.left  # tokens it took for this step and has not spent (0 between steps)
        if left:
            u.left = left - 1
        elif u.step != step:  # its first charge this step: tokens for its running requests
            u.step = step
            want = u.resident - u.n_held
            left = self.limiter.take_upto(u.bucket, self._now, want if want > 1 else 1)
            if left > 1:
                u.left = left - 1
                self._st.users.append(u)  # what it does not spend goes back at the fold
        elif u.refused_step != step:  # more than it had running (admitted this step): one more
            left = self.limiter.take_upto(u.bucket, self._now, 1)
        if not left and not (
            u.bucket.limit.shadow and self.ledger.shadow_over(rs, u, step, self._now)
        ):
            # Out of committed budget: a borrower (lending.py) takes a token of
            # its peak from the capacity this step's plan left it.
            if not (rs.borrowing and self.limiter.borrow(u.bucket, self._now)):
                return self.admission.refuse(request, rs, u, step, num_computed_tokens)
            rs.borrowed_step = step
            self.lending.charged(rs, u)
        rs.charged_step = step
        self._st.last_charge = request  # a refund candidate (state.py)
        self.ledger.charge(rs, u, self._now)
        return num_new_tokens

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):  # type: ignore[misc]
            return False
        return self.admission.admit(
            request, self._step, self._now, len(self.running), self.max_num_active_reqs
        )

    # -- one step ---------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> Any:
        self._step += 1
        now = self._now = self._clock()
        if self._lends:
            self.step_cost.tick(now)  # the step before ended: its length (steptime.py)
        self.ledger.begin(now)
        policy = self.policy_box.current
        if policy is not self._policy:
            self.swap_policy(policy, now)  # a reload, at a step's start
        self._st.blocked_ready = 0
        self._st.prefill_granted = 0
        holdback = self.holdback
        if holdback.wake:  # borrowers' slots count as free: the plan reclaims them
            room = self._cfg_active - len(self.running) + len(self.lending)
            self._st.touched += holdback.release_ready(now, room, self.running)
        if self._lends and (holdback or self.lending or len(self.waiting) or self._plends):
            self.running = self.lending.plan(
                now,
                self._step,
                self.running,
                self._users.values(),
                self.waiting,
                self._cfg_active,  # releasing a held borrower keeps its resident slot
                self.max_num_running_reqs - len(self.running) - len(holdback),
                self.max_num_scheduled_tokens,
            )
        if self._lends and holdback:
            self._displace_lenders(now)
        if holdback and len(self.running) + len(holdback) >= self.max_num_running_reqs:
            self._displace(now)
        self._alloc.install(bool(holdback))  # held requests: preempted first (kv.py)
        # Held requests keep resident slots: admission needs
        # running + held < max_num_seqs and running < max_num_active_seqs.
        self.max_num_active_reqs = min(self._cfg_active, self.max_num_running_reqs - len(holdback))
        st = self._st
        if st.deferrals and len(self.waiting):  # requests admission would defer again: out
            st.deferrals = self.parking.park(
                self.waiting, self._step, now, len(self.running), self.max_num_active_reqs
            )
        else:
            st.deferrals = 0
        visited = len(self.running)  # what stock's running loop walks: no held request
        try:
            out = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = self._cfg_active
            if self.parking.parked:  # back where they were (parking.py)
                self.parking.unpark(self.waiting, not self._priority)
        if self._lends:
            self.step_cost.dispatched(
                now, len(out.num_scheduled_tokens), out.total_num_scheduled_tokens
            )
        self._after_schedule(out.num_scheduled_tokens, now, visited)
        quota = self.quota
        if quota is not None and now >= quota.next_ns:
            quota.next_ns = now + FOLD_INTERVAL_NS
            quota.fold(self.requests.values())
        return out

    def _after_schedule(self, scheduled: dict[str, int], now: int, visited: int) -> None:
        st = self._st
        self.ledger.refund_missed(st, scheduled, self._step, now)  # charged, not scheduled
        if st.stash:  # held victims of a KV allocation (kv.py): back at the front
            for r in reversed(st.stash):
                self.waiting.prepend_request(r)
            st.stash.clear()
        if st.admits:
            if self.lending:
                for r in st.admits:
                    if r.status != _RUNNING:
                        self.lending.stop(r)  # a borrower stock did not admit after all
            self.admission.undo_unadmitted(st.admits, _RUNNING)
        if st.refused:  # refused and not scheduled after all: held (holdback.py)
            held = self.holdback.hold_refused(st.refused, scheduled, now, _RUNNING)
            if held:
                if self.lending:
                    for r in held:
                        self.lending.stop(r)  # its peak ran out: held like anyone
                self.running = remove_all(self.running, set(held))
        if st.touched:
            self.holdback.arm_touched(st.touched, now)
        self.ledger.fold(st, now)
        if self.recorder is not None:
            # the step's predicted length and the slope lending used, where the model runs
            cost = self.step_cost
            predicted, per_seq = (cost.timed_us(), cost.per_seq_us()) if self._lends else (0, 0)
            self.recorder.write(
                scheduled, self.requests, self._step, now, visited, predicted, per_seq
            )
        self.limiter.cleanup(now, 4)
        # Idle users of the prompt table go too; a shared prompt budget's step boundary.
        self.prompt_table.cleanup(now, 4)

    def _displace(self, now: int) -> None:
        """Fair admission (admission.py): one held request gives its slot to a
        waiting user with budget (preempted and requeued; prefix cache keeps
        what it can)."""
        victim = self.admission.displacement(self._users.values(), self._step, now)
        if victim is not None:
            self._preempt_request(victim, time.monotonic())
            self.metrics.displaced += 1

    def _displace_lenders(self, now: int) -> None:
        """Borrowing users' held requests give their resident slots to every
        committed newcomer at once (lending.py)."""
        free = self.max_num_running_reqs - len(self.running) - len(self.holdback)
        victims = self.lending.displaced(self._users.values(), free)
        for r in victims:
            self._preempt_request(r, time.monotonic())
        self.metrics.displaced += len(victims)

    # -- engine loop --------------------------------------------------------

    def outrate_idle_wait_ns(self) -> int:
        """How long the engine may block on its input queue after a step that
        ran nothing: until the earliest throttled user is ready, at most 50 ms.
        0 when no throttling explains the idle step (stock behaviour)."""
        if getattr(self, "_pause_state", PauseState.UNPAUSED) != PauseState.UNPAUSED:
            return 0
        earliest = self.holdback.earliest_ready(self._st.blocked_ready)
        return min(max(earliest - self._clock(), 0), IDLE_WAIT_MAX_NS) if earliest else 0


class OutrateScheduler(OutrateMixin, Scheduler):
    """Rate-limited synchronous scheduler."""


class OutrateAsyncScheduler(OutrateMixin, AsyncScheduler):
    """Rate-limited async scheduler (used when vLLM enables async scheduling)."""
