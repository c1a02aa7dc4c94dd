"""The rate-limited vLLM V1 scheduler: a thin adapter over vLLM 0.32's
`Scheduler` / `AsyncScheduler` (the overridden methods and why are indexed in
vllm_integration/__init__.py).

One step, top to bottom (`schedule`): swap in a reloaded policy; release held
requests whose user's budget returned; displace one held request if every
resident slot is taken and a user with budget waits; run stock `schedule()`,
during which the hooks charge each sampling dispatch (`_reserve_prefill_lookahead`)
and defer admissions (`_handle_blocked_waiting_request`); then settle the step
(`_after_schedule`): refunds, requeue, holds, wake-ups, metrics and trace.

The machinery lives beside it: `Holdback` (holdback.py) parks throttled
running requests outside `running` and wakes them; `Ledger` (ledger.py)
settles refunds, metrics and the trace; `StepScratch` (state.py) is what one
step carries to its end. Policy decisions are the core's (`outrate.limiter`
behind the `BudgetStore` protocol).

Holdback restores two stock behaviours explicitly: `len(running) + held <=
max_num_seqs` (the admission cap `max_num_active_reqs` is lowered for the
step), and held requests are the preferred preemption victims
(`kv_cache_manager.allocate_slots` is wrapped, only in steps that start with
held requests: the wrapper costs a Python call per allocation).
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

from outrate.compiler import CompiledPolicy
from outrate.errors import OutrateError
from outrate.identity import Stamper, resolve_identity
from outrate.limiter import Limiter
from outrate.metrics import Metrics
from outrate.store import BudgetStore
from vllm_integration.holdback import Holdback
from vllm_integration.ledger import Ledger
from vllm_integration.state import ATTR, PolicyBox, RequestState, StepScratch, UserState

logger = logging.getLogger("vllm.outrate")  # under vLLM's logger: same format and level

IDLE_WAIT_MAX_NS = 50_000_000
"""Longest the engine waits on its input queue when everyone is throttled."""

DISPLACE_SCAN = 32
"""Waiting requests examined per step for fair-admission displacement."""

_CONNECTORS = (
    ("connector", "a KV connector"),
    ("ec_connector", "an EC connector"),
    ("aux_output_connector", "an aux output connector"),
)


class OutrateMixin:
    """The rate-limiting behaviour, mixed into vLLM's Scheduler classes."""

    # Provided by vLLM's Scheduler (declared for readers and type checkers).
    running: list[Request]
    requests: dict[str, Request]
    max_num_running_reqs: int
    max_num_active_reqs: int
    waiting: Any
    kv_cache_manager: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from vllm_integration.config import policy_from_vllm_config
        from vllm_integration.engine import install_idle_wait
        from vllm_integration.threads import start_engine_threads

        for attr, what in _CONNECTORS:
            if getattr(self, attr, None) is not None:
                raise OutrateError(
                    f"outrate cannot run with {what}: its tokens and KV move outside "
                    "the scheduler decisions the per-user limiter makes"
                )
        policy, settings = policy_from_vllm_config(self.vllm_config)  # type: ignore[attr-defined]
        self.outrate_configure(policy)
        logger.info("outrate: %s", policy.summary())
        if policy.shadow_rules:
            shadow = ", ".join(policy.shadow_rules)
            logger.info("outrate: shadow (counted, not enforced): %s", shadow)
        self._threads = start_engine_threads(self, settings)
        install_idle_wait()

    def shutdown(self) -> None:
        threads = getattr(self, "_threads", None)
        if threads is not None:
            threads.stop()
        super().shutdown()  # type: ignore[misc]

    def outrate_configure(
        self, policy: CompiledPolicy | PolicyBox, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        """(Re)wire the limiter. The engine calls this once; tests pass a fake clock."""
        self.policy_box = policy if isinstance(policy, PolicyBox) else PolicyBox(policy)
        self._policy = self.policy_box.current  # the one the limiter enforces
        # Verifies the identity the API server signed (identity.source header/api_key).
        self._stamper = Stamper.from_env()
        self.limiter: BudgetStore = Limiter(self._policy, clock=clock)
        self._take = self.limiter.take  # bound once: called for every sampling dispatch
        self._clock = clock
        self.stats = {"charged": 0, "refunded": 0, "held": 0, "released": 0, "displaced": 0}
        self.metrics = Metrics()
        sc = self.scheduler_config  # type: ignore[attr-defined]
        self._priority = self.policy == SchedulingPolicy.PRIORITY  # type: ignore[attr-defined]
        self.holdback = Holdback(self.limiter, self._priority, self.stats)
        self.ledger = Ledger(self.limiter, self.metrics, self.stats)
        self._st = StepScratch()
        self._users: dict[str, UserState] = {}
        self._step = 0
        self._now = 0
        self._cfg_active = self.max_num_active_reqs
        self._chunked = bool(sc.enable_chunked_prefill)
        self._lookahead = getattr(self, "num_prefill_lookahead", 0) > 1
        self._block_size = self.block_size  # type: ignore[attr-defined]
        self._caching = bool(self.cache_config.enable_prefix_caching)  # type: ignore[attr-defined]
        kvm = self.kv_cache_manager
        kvm.__dict__.pop("allocate_slots", None)  # re-wiring: back to the class method
        self._stock_allocate = kvm.allocate_slots
        for req in self.requests.values():  # only tests re-wire a scheduler with requests
            self._register(req)

    def outrate_trace(self, trace: Any) -> None:
        """Write a trace line per step to `trace` (a TraceWriter)."""
        self.ledger.trace = trace
        self.holdback.trace_held, self.holdback.trace_released = {}, {}

    @property
    def n_held(self) -> int:
        return len(self.holdback)

    # -- users and request lifecycle ------------------------------------------

    def _user(self, key: str) -> UserState:
        u = self._users.get(key)
        if u is None:
            label = self.metrics.label_of(key, self._policy)
            u = UserState(key, self.limiter.pin(key), self.metrics.record(label))
            self._users[key] = u
        return u

    def _register(self, request: Request) -> None:
        source = self.policy_box.current.identity.source  # the newest: trust changes at once
        u = self._user(resolve_identity(request.sampling_params, logger, source, self._stamper))
        u.live += 1
        u.m.live += 1
        rs = RequestState(u)
        if request.status == RequestStatus.RUNNING:
            rs.resident = True
            u.resident += 1
        request.__dict__[ATTR] = rs

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            self._register(request)
        super().add_request(request)  # type: ignore[misc]

    def _leave_slot(self, rs: RequestState, request: Request) -> None:
        if rs.held:
            self.holdback.leave(rs, request, self._clock())
        if rs.resident:
            rs.resident = False
            rs.user.resident -= 1

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        rs = request.__dict__.pop(ATTR, None)
        if rs is not None:
            self._leave_slot(rs, request)
            u = rs.user
            u.live -= 1
            u.m.live -= 1
            if u.live == 0:
                del self._users[u.key]
                self.limiter.unpin(u.bucket)
        return super()._free_request(request, delay_free_blocks)  # type: ignore[misc]

    def _preempt_request(
        self, request: Request, timestamp: float, drop_stale_output: bool = False
    ) -> None:
        rs = request.__dict__.get(ATTR)
        if rs is not None:
            self._leave_slot(rs, request)
            rs.preempted_step = self._step
            if rs.charged_step == self._step:
                self._st.preempted_charged.append(request)  # refunded after the step
        super()._preempt_request(request, timestamp, drop_stale_output)  # type: ignore[misc]

    def get_request_counts(self) -> tuple[int, int]:
        running, waiting = super().get_request_counts()  # type: ignore[misc]
        return running + len(self.holdback), waiting

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
        if self._lookahead:
            num_new_tokens = super()._reserve_prefill_lookahead(  # type: ignore[misc]
                request, num_computed_tokens, num_new_tokens
            )
        num_tokens = len(request._all_token_ids)  # == request.num_tokens, minus a property call
        if num_new_tokens == 0 or num_computed_tokens + num_new_tokens < num_tokens:
            return num_new_tokens  # nothing sampled: middle prefill chunks are free
        rs: RequestState = request.__dict__[ATTR]
        step = self._step
        if rs.charged_step == step:
            return num_new_tokens  # never charge a request twice in a step
        u = rs.user
        if u.refused_step != step:
            bucket = u.bucket
            if self._take(bucket, self._now) or self._shadow_over(bucket, rs, u):
                last = rs.charged_step
                rs.charged_step = step
                st = self._st
                st.n_charged += 1
                if request.status == RequestStatus.RUNNING:
                    st.last_charge_running = request
                else:
                    st.last_charge_waiting = request
                # Metrics: counted on the user, folded once per step (Ledger.fold).
                if u.step != step:
                    u.step = step
                    st.users.append(u)
                now = self._now
                prev = rs.prev_ns = rs.last_ns
                if last == step - 1:
                    u.st_consec += 1  # interval = this step's period, observed at the fold
                else:
                    u.st_gap += 1
                    if prev:
                        u.m.interval.observe(now - prev)
                rs.last_ns = now
                return num_new_tokens
            u.refused_step = step
            self._st.touched.append(u)
        # Out of budget: prefill up to the last prompt position, sample later.
        if self._chunked and num_computed_tokens < num_tokens - 1:
            return num_tokens - 1 - num_computed_tokens
        if rs.resident:
            self._st.refused.append(request)
        return 0

    def _shadow_over(self, bucket: Any, rs: RequestState, u: UserState) -> bool:
        """A shadow limit refused a token: count it, let it run."""
        if not bucket.limit.shadow:
            return False
        rs.over_step = self._step
        u.st_over += 1
        return True

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):  # type: ignore[misc]
            return False
        rs: RequestState = request.__dict__[ATTR]
        if rs.preempted_step == self._step:
            return False  # displaced or preempted this step: not back in the same step
        u = rs.user
        now = self._now
        limit = self.limiter.limit_of(u.bucket, now)
        if limit.shadow:
            pass  # computed and counted, never enforced
        elif limit.max_streams is not None and u.resident >= limit.max_streams:
            return self._defer(rs, "max_streams")  # waits without blocking anyone else
        elif u.refused_step == self._step or u.n_held or self.limiter.available(u.bucket, now) == 0:
            if (
                not self._can_prefill_ahead(request)
                or len(self.running) + 1 >= self.max_num_active_reqs
            ):
                ready = self.limiter.ready_at(u.bucket, now)
                st = self._st
                if st.blocked_ready == 0 or ready < st.blocked_ready:
                    st.blocked_ready = ready
                return self._defer(rs, "budget")
        rs.deferred = ""
        # Counted as resident now (so max_streams holds within one step);
        # undone after the step if stock did not admit it after all.
        rs.resident = True
        u.resident += 1
        self._st.admits.append(request)
        return True

    def _defer(self, rs: RequestState, reason: str) -> bool:
        """Admission deferred; counted once per deferral, not per step."""
        if rs.deferred != reason:
            rs.deferred = reason
            self.metrics.deferred[reason] += 1
        return False

    def _can_prefill_ahead(self, request: Request) -> bool:
        """Whether a throttled request can be admitted to prefill without
        sampling. (The caller also keeps the last free seat for users with
        budget.) Stock stops admitting everyone when the lookahead hook
        returns 0 in the waiting loop, so admit only when the cap
        `num_tokens - 1 - computed` is positive whatever the prefix-cache hit
        (hits are whole blocks of at most `num_tokens - 1` tokens)."""
        if not self._chunked or request.num_computed_tokens:
            return False
        n = request.num_tokens
        if n < 2:
            return False
        return not self._caching or (n - 1) % self._block_size != 0

    def _allocate_slots(
        self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        """KV allocation that preempts held (throttled) requests first."""
        alloc = self._stock_allocate
        holdback = self.holdback
        if holdback and kwargs.get("has_scheduled_reqs") is False:
            kwargs["has_scheduled_reqs"] = True  # held requests are scheduled work too
        while True:
            blocks = alloc(request, num_new_tokens, *args, **kwargs)
            if blocks is not None or not holdback:
                return blocks
            victim = holdback.kv_victim(self.running)
            if victim is None:
                return None  # a visible lower-priority request goes first (stock's choice)
            # Stock's admission loop peeks the head of `waiting` and pops it
            # later: keep the victim aside, requeue it at the front after the step.
            self._preempt_request(victim, time.monotonic())
            self.waiting.remove_request(victim)
            self._st.stash.append(victim)

    # -- one step ---------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> Any:
        self._step += 1
        now = self._now = self._clock()
        policy = self.policy_box.current
        if policy is not self._policy:
            self._swap_policy(policy, now)
        self._st.blocked_ready = 0
        holdback = self.holdback
        if holdback.wake:
            room = self._cfg_active - len(self.running)
            self._st.touched += holdback.release_ready(now, room, self.running)
        if holdback and len(self.running) + len(holdback) >= self.max_num_running_reqs:
            self._displace(now)
        kvm = self.kv_cache_manager
        if holdback:
            kvm.allocate_slots = self._allocate_slots
        elif "allocate_slots" in kvm.__dict__:
            del kvm.allocate_slots
        # Held requests keep resident slots: admission needs
        # running + held < max_num_seqs and running < max_num_active_seqs.
        self.max_num_active_reqs = min(self._cfg_active, self.max_num_running_reqs - len(holdback))
        try:
            out = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = self._cfg_active
        self._after_schedule(out.num_scheduled_tokens, now)
        return out

    def _after_schedule(self, scheduled: dict[str, int], now: int) -> None:
        st = self._st
        if st.n_charged:
            self.ledger.refund_missed(st, scheduled, self._step, now)
        if st.stash:
            self._requeue_stashed(st)
        if st.admits:
            self._undo_unadmitted(st)
        if st.refused:
            self._hold_refused(st, scheduled, now)
        if st.touched:
            self._arm_touched(st, now)
        self.ledger.fold(st, self._step, now, self.holdback)
        self.limiter.cleanup(now, 4)

    def _requeue_stashed(self, st: StepScratch) -> None:
        for r in reversed(st.stash):
            self.waiting.prepend_request(r)
        st.stash.clear()

    def _undo_unadmitted(self, st: StepScratch) -> None:
        for r in st.admits:
            rs = r.__dict__.get(ATTR)
            if rs is not None and rs.resident and r.status != RequestStatus.RUNNING:
                rs.resident = False
                rs.user.resident -= 1
        st.admits.clear()

    def _hold_refused(self, st: StepScratch, scheduled: dict[str, int], now: int) -> None:
        hold = {
            r
            for r in st.refused
            if r.status == RequestStatus.RUNNING and r.request_id not in scheduled
        }
        st.refused.clear()
        if hold:
            self.running = remove_all(self.running, hold)
            for r in hold:
                self.holdback.hold(r, now)

    def _arm_touched(self, st: StepScratch, now: int) -> None:
        for u in st.touched:
            if u.n_held and not u.armed:
                self.holdback.arm(u, now)
        st.touched.clear()

    def _displace(self, now: int) -> None:
        """Fair admission: when every resident slot is taken, a waiting request
        of a user with budget displaces a held request of the user holding the
        most slots (preempted and requeued; prefix cache keeps what it can).
        At most one per step, after a bounded scan of the queue head."""
        limiter = self.limiter
        for i, r in enumerate(self.waiting):
            if i >= DISPLACE_SCAN:
                return
            rs = r.__dict__.get(ATTR)
            if rs is None:
                continue
            u = rs.user
            if u.n_held or u.refused_step == self._step or limiter.available(u.bucket, now) == 0:
                continue
            ms = limiter.limit_of(u.bucket, now).max_streams
            if ms is not None and u.resident >= ms:
                continue
            victim = self.holdback.displacement_victim(u, self._users.values())
            if victim is not None:
                self._preempt_request(victim, time.monotonic())
                self.stats["displaced"] += 1
                self.metrics.displaced += 1
            return  # one per step; none when slots are already shared fairly

    def _swap_policy(self, policy: CompiledPolicy, now: int) -> None:
        self._policy = policy
        self.limiter.set_policy(policy, now)
        logger.debug("outrate: scheduler switched to %s", policy.summary())
        self.holdback.rearm(self._users.values(), now)
        for u in self._users.values():
            self.ledger.relabel(u, policy)
        if self.ledger.trace is not None:
            self.ledger.trace.event(now, policy=policy.sha256, source=policy.source)

    # -- engine loop --------------------------------------------------------

    def outrate_idle_wait_ns(self) -> int:
        """How long the engine may block on its input queue after a step that
        ran nothing: until the earliest throttled user is ready, at most 50 ms.
        0 when no throttling explains the idle step (stock behaviour)."""
        if getattr(self, "_pause_state", PauseState.UNPAUSED) != PauseState.UNPAUSED:
            return 0
        earliest = self.holdback.earliest_ready()
        blocked = self._st.blocked_ready
        if blocked and (earliest == 0 or blocked < earliest):
            earliest = blocked
        if earliest == 0:
            return 0
        wait = earliest - self._clock()
        return min(max(wait, 0), IDLE_WAIT_MAX_NS)


class OutrateScheduler(OutrateMixin, Scheduler):
    """Rate-limited synchronous scheduler."""


class OutrateAsyncScheduler(OutrateMixin, AsyncScheduler):
    """Rate-limited async scheduler (used when vLLM enables async scheduling)."""


def outrate_scheduler(*args: Any, **kwargs: Any) -> Scheduler:
    """`--scheduler-cls` target: picks the variant vLLM itself would pick."""
    vllm_config: Any = kwargs.get("vllm_config", args[0] if args else None)
    cls = (
        OutrateAsyncScheduler if vllm_config.scheduler_config.async_scheduling else OutrateScheduler
    )
    return cls(*args, **kwargs)
