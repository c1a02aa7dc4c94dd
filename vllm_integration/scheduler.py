"""The rate-limited vLLM V1 scheduler.

Every touch of vLLM's scheduler internals lives in this file. It subclasses
vLLM 0.32.0's `Scheduler` / `AsyncScheduler` and overrides these methods:

- `_reserve_prefill_lookahead`: called by stock `schedule()` for every running
  and waiting request right before its `num_new_tokens == 0` check. A dispatch
  that will sample (`num_computed + n >= num_tokens`) is charged one token here;
  out of budget we return 0 (skip) or cap a prefill one short of sampling.
- `_handle_blocked_waiting_request`: called for every waiting request peeked
  by the admission loop. Returning False makes stock *skip* (defer) the
  request instead of stopping admission, so a throttled user never stalls the
  queue. Also enforces `max_streams`.
- `add_request` / `_free_request` / `_preempt_request`: per-request bookkeeping.
- `get_request_counts` / `reset_prefix_cache`: account for held-back requests.
- `schedule()`: wraps stock with release, displacement, the one refund point
  and holdback.

Holdback: a running request whose user is out of budget is taken out of
`self.running` until its user's ready time, so stock's loop never visits it
(per-step cost does not grow with throttled requests). It keeps its KV blocks
and its resident slot. Two stock behaviours that a naive holdback breaks are
restored explicitly: `len(running) + held <= max_num_seqs` (the admission cap
`max_num_active_reqs` is lowered for the step), and held requests are the
preferred preemption victims (`kv_cache_manager.allocate_slots` is wrapped,
only for steps that start with held requests: the wrapper costs a Python call
per allocation).

Written against vLLM 0.32.0 (pinned). When vLLM grows a public scheduler
policy hook, this file is what goes.
"""

from __future__ import annotations

import heapq
import logging
import time
from bisect import bisect_left
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
from outrate.identity import resolve_identity
from outrate.limiter import Limiter
from outrate.metrics import BUCKETS_NS, Metrics
from outrate.store import BudgetStore
from vllm_integration.state import ATTR, PolicyBox, RequestState, UserState, is_held

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

    # Attributes provided by vLLM's Scheduler (declared for readers/type checkers).
    running: list[Request]
    requests: dict[str, Request]
    max_num_running_reqs: int
    max_num_active_reqs: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        from vllm_integration.config import policy_from_vllm_config
        from vllm_integration.engine import install_idle_wait

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
        self._reloader = None
        if settings.get("reload", "watch") != "off" and "policy" in settings:
            from outrate.reload import Reloader

            box = self.policy_box

            def publish(new: CompiledPolicy) -> None:
                box.current = new  # read by schedule() at the next step boundary

            self._reloader = Reloader(
                settings["policy"],
                publish,
                initial=policy,
                logger=logging.getLogger("vllm.outrate.reload"),
            )
            self._reloader.start()
        from vllm_integration.telemetry import start_telemetry

        self._telemetry = start_telemetry(self, settings)
        install_idle_wait()

    def shutdown(self) -> None:
        reloader = getattr(self, "_reloader", None)
        if reloader is not None:
            reloader.stop()
        telemetry = getattr(self, "_telemetry", None)
        if telemetry is not None:
            telemetry.stop()
        super().shutdown()  # type: ignore[misc]

    # -- wiring -----------------------------------------------------------

    def outrate_configure(
        self, policy: CompiledPolicy | PolicyBox, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        """(Re)wire the limiter. The engine calls this once; tests pass a fake clock."""
        self.policy_box = policy if isinstance(policy, PolicyBox) else PolicyBox(policy)
        self.limiter: BudgetStore = Limiter(self.policy_box.current, clock=clock)
        self._take = self.limiter.take  # bound once: called for every sampling dispatch
        self._clock = clock
        self.metrics = Metrics()
        self._trace: Any = None  # a TraceWriter when --outrate-trace is given
        self._step_users: list[UserState] = []  # users charged this step
        self._prev_now = 0
        self._tr_held: dict[str, int] = {}
        self._tr_released: dict[str, int] = {}
        self._users: dict[str, UserState] = {}
        self._held: dict[Request, None] = {}  # insertion-ordered: newest held last
        self._wake: list[tuple[int, int, UserState]] = []
        self._seq = 0
        self._step = 0
        self._now = 0
        # Refund candidates: a charged request can miss the step only if its KV
        # allocation failed (then it is the last one charged in its loop: both
        # of stock's loops stop there) or if it was preempted afterwards.
        self._last_charge_running: Request | None = None
        self._last_charge_waiting: Request | None = None
        self._preempted_charged: list[Request] = []
        self._n_charged = 0
        self._refused: list[Request] = []
        self._touched: list[UserState] = []
        self._admits: list[Request] = []
        self._stash: list[Request] = []
        self._blocked_ready = 0
        self._cfg_active = self.max_num_active_reqs
        sc = self.scheduler_config  # type: ignore[attr-defined]
        self._chunked = bool(sc.enable_chunked_prefill)
        self._priority = self.policy == SchedulingPolicy.PRIORITY  # type: ignore[attr-defined]
        self._lookahead = getattr(self, "num_prefill_lookahead", 0) > 1
        self._block_size = self.block_size  # type: ignore[attr-defined]
        self._caching = bool(self.cache_config.enable_prefix_caching)  # type: ignore[attr-defined]
        kvm = self.kv_cache_manager  # type: ignore[attr-defined]
        kvm.__dict__.pop("allocate_slots", None)  # re-wiring: back to the class method
        self._stock_allocate = kvm.allocate_slots
        self.stats = {"charged": 0, "refunded": 0, "held": 0, "released": 0, "displaced": 0}
        # Requests already in the scheduler (only in tests that re-wire) join now.
        for req in self.requests.values():
            self._register(req)

    @property
    def n_held(self) -> int:
        return len(self._held)

    def _user(self, key: str) -> UserState:
        u = self._users.get(key)
        if u is None:
            metrics = self.metrics
            label = metrics.label_of(key, self.limiter.policy)
            u = UserState(key, self.limiter.pin(key), metrics.record(label))
            self._users[key] = u
        return u

    def _register(self, request: Request) -> None:
        u = self._user(resolve_identity(request.sampling_params, logger))
        u.live += 1
        u.m.live += 1
        rs = RequestState(u)
        if request.status == RequestStatus.RUNNING:
            rs.resident = True
            u.resident += 1
        request.__dict__[ATTR] = rs

    # -- request lifecycle --------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            self._register(request)
        super().add_request(request)  # type: ignore[misc]

    def _leave_slot(self, rs: RequestState, request: Request) -> None:
        if rs.held:
            rs.held = False
            del self._held[request]
            rs.user.n_held -= 1  # its heap entry is skipped lazily
            rs.user.m.unhold(rs.held_since, self._clock())
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
                self._preempted_charged.append(request)  # refunded after the step
        super()._preempt_request(request, timestamp, drop_stale_output)  # type: ignore[misc]

    def get_request_counts(self) -> tuple[int, int]:
        running, waiting = super().get_request_counts()  # type: ignore[misc]
        return running + len(self._held), waiting

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        if reset_running_requests:
            self._release_all()
        return super().reset_prefix_cache(reset_running_requests, reset_connector)  # type: ignore[misc]

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
                self._n_charged += 1
                if request.status == RequestStatus.RUNNING:
                    self._last_charge_running = request
                else:
                    self._last_charge_waiting = request
                # Metrics: counted on the user, folded per step (_fold_step).
                if u.step != step:
                    u.step = step
                    self._step_users.append(u)
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
            self._touched.append(u)
        # Out of budget: prefill up to the last prompt position, sample later.
        if self._chunked and num_computed_tokens < num_tokens - 1:
            return num_tokens - 1 - num_computed_tokens
        if rs.resident:
            self._refused.append(request)
        return 0

    def _shadow_over(self, bucket: Any, rs: RequestState, u: UserState) -> bool:
        """A shadow limit refused a token: count it, let it run."""
        if not bucket.limit.shadow:
            return False
        rs.over_step = self._step
        u.st_over += 1
        return True

    def _defer(self, rs: RequestState, reason: str) -> bool:
        """Admission deferred; counted once per deferral, not per step."""
        if rs.deferred != reason:
            rs.deferred = reason
            self.metrics.deferred[reason] += 1
        return False

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
                if self._blocked_ready == 0 or ready < self._blocked_ready:
                    self._blocked_ready = ready
                return self._defer(rs, "budget")
        rs.deferred = ""
        # Counted as resident now (so max_streams holds within one step);
        # undone after the step if stock did not admit it after all.
        rs.resident = True
        u.resident += 1
        self._admits.append(request)
        return True

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
        if self._held and kwargs.get("has_scheduled_reqs") is False:
            kwargs["has_scheduled_reqs"] = True  # held requests are scheduled work too
        while True:
            blocks = alloc(request, num_new_tokens, *args, **kwargs)
            if blocks is not None or not self._held:
                return blocks
            victim = self._held_victim()
            if victim is None:
                return None
            self._preempt_out_of_band(victim)

    def _held_victim(self) -> Request | None:
        if not self._priority:
            return next(reversed(self._held))  # most recently throttled
        victim = max(self._held, key=lambda r: (r.priority, r.arrival_time))
        if self.running and victim.priority < max(r.priority for r in self.running):
            return None  # a visible lower-priority request goes first (stock's choice)
        return victim

    def _preempt_out_of_band(self, victim: Request) -> None:
        """Preempt a held request while stock's loop runs. Stock's admission
        loop peeks the head of `waiting` and pops it later, so the victim is
        kept aside and requeued at the front after `schedule()`."""
        self._preempt_request(victim, time.monotonic())
        self.waiting.remove_request(victim)  # type: ignore[attr-defined]
        self._stash.append(victim)

    # -- schedule() -----------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> Any:
        self._step += 1
        now = self._now = self._clock()
        policy = self.policy_box.current
        if policy is not self.limiter.policy:
            self._swap_policy(policy, now)
        self._blocked_ready = 0
        if self._wake:
            self._release(now)
        if self._held and len(self.running) + len(self._held) >= self.max_num_running_reqs:
            self._displace(now)
        kvm = self.kv_cache_manager  # type: ignore[attr-defined]
        if self._held:
            kvm.allocate_slots = self._allocate_slots
        elif "allocate_slots" in kvm.__dict__:
            del kvm.allocate_slots
        # Held requests keep resident slots: admission needs
        # running + held < max_num_seqs and running < max_num_active_seqs.
        self.max_num_active_reqs = min(
            self._cfg_active, self.max_num_running_reqs - len(self._held)
        )
        try:
            out = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = self._cfg_active
        self._after_schedule(out.num_scheduled_tokens, now)
        return out

    def _after_schedule(self, scheduled: dict[str, int], now: int) -> None:
        limiter = self.limiter
        # The one refund point: charged but not scheduled (KV allocation
        # failed, or preempted later in the same step). O(1): see the
        # candidates' comment in outrate_configure.
        if self._n_charged:
            refunded = 0
            candidates = self._preempted_charged
            for r in (self._last_charge_running, self._last_charge_waiting, *candidates):
                if r is not None and r.request_id not in scheduled:
                    rs = r.__dict__.get(ATTR)
                    if rs is not None and rs.charged_step == self._step:
                        u = rs.user
                        if rs.over_step == self._step:
                            u.st_over -= 1  # a shadow over-limit token: nothing was taken
                        elif u.bucket.limit.scale:
                            limiter.give_back(u.bucket, now)
                        u.st_refunded += 1
                        self._unobserve(rs, u, now)
                        rs.charged_step = -1  # never refunded twice
                        refunded += 1
            self.stats["charged"] += self._n_charged - refunded
            self.stats["refunded"] += refunded
            self._n_charged = 0
            self._last_charge_running = self._last_charge_waiting = None
            candidates.clear()
        if self._stash:
            for r in reversed(self._stash):
                self.waiting.prepend_request(r)  # type: ignore[attr-defined]
            self._stash.clear()
        if self._admits:
            for r in self._admits:
                rs = r.__dict__.get(ATTR)
                if rs is not None and rs.resident and r.status != RequestStatus.RUNNING:
                    rs.resident = False
                    rs.user.resident -= 1
            self._admits.clear()
        refused = self._refused
        if refused:
            hold = {
                r
                for r in refused
                if r.status == RequestStatus.RUNNING and r.request_id not in scheduled
            }
            refused.clear()
            if hold:
                self.running = remove_all(self.running, hold)
                for r in hold:
                    self._hold(r)
        touched = self._touched
        if touched:
            for u in touched:
                if u.n_held and not u.armed:
                    self._arm(u, now)
            touched.clear()
        if self._step_users or self._trace is not None:
            self._fold_step(now)
        self._prev_now = now
        limiter.cleanup(now, 4)

    def _unobserve(self, rs: RequestState, u: UserState, now: int) -> None:
        """A refunded token was never sampled: take back its interval."""
        prev = rs.last_ns = rs.prev_ns
        if prev and prev == self._prev_now:
            u.st_consec -= 1
            return
        u.st_gap -= 1
        if prev:
            h = u.m.interval
            h.buckets[bisect_left(BUCKETS_NS, now - prev)] -= 1
            h.sum_ns -= now - prev

    def _fold_step(self, now: int) -> None:
        """Once per step: this step's charges into each label's metrics (and
        one trace line). Requests charged in the previous step too get this
        step's period as their token interval, observed once per user."""
        period = now - self._prev_now
        trace = self._trace
        charged: dict[str, int] = {}
        refunded: dict[str, int] = {}
        over: dict[str, int] = {}
        for u in self._step_users:
            m = u.m
            m.tokens += u.st_consec + u.st_gap  # net: refunds took theirs back
            if u.st_consec:
                m.interval.observe(period, u.st_consec)
            if u.st_over:
                m.shadow_over += u.st_over
            if trace is not None:
                gross = u.st_consec + u.st_gap + u.st_refunded
                if gross:
                    charged[u.key] = gross
                if u.st_refunded:
                    refunded[u.key] = u.st_refunded
                if u.st_over:
                    over[u.key] = u.st_over
            u.st_consec = u.st_gap = u.st_refunded = u.st_over = 0
        self._step_users.clear()
        if trace is not None and (charged or self._tr_held or self._tr_released):
            trace.step((now, self._step, charged, refunded, self._tr_held, self._tr_released, over))
            self._tr_held = {}
            self._tr_released = {}

    def _hold(self, r: Request) -> None:
        rs: RequestState = r.__dict__[ATTR]
        rs.held = True
        self._held[r] = None
        self._seq += 1
        u = rs.user
        rs.held_since = self._now
        u.m.hold(self._now)
        if self._trace is not None:
            self._tr_held[u.key] = self._tr_held.get(u.key, 0) + 1
        heapq.heappush(u.held, (r.priority if self._priority else 0, self._seq, r))
        u.n_held += 1
        self.stats["held"] += 1

    def _arm(self, u: UserState, now: int) -> None:
        u.ready_at = self.limiter.ready_at(u.bucket, now)
        u.armed = True
        self._seq += 1
        heapq.heappush(self._wake, (u.ready_at, self._seq, u))

    def _release(self, now: int) -> None:
        """Put back users whose budget returned, as many streams as they can
        use now, oldest-held first (streams of a user rotate)."""
        wake = self._wake
        room = self._cfg_active - len(self.running)
        while wake and wake[0][0] <= now and room > 0:
            ready, _, u = heapq.heappop(wake)
            if not u.wakes_at(ready):
                continue  # stale entry
            u.armed = False
            if not u.n_held:
                continue
            k = min(self.limiter.available(u.bucket, now), room)
            if k == 0:  # policy changed under it: arm again
                self._arm(u, now)
                continue
            room -= self._release_user(u, k, now)
            if u.n_held:
                self._touched.append(u)  # re-armed after this step

    def _release_user(self, u: UserState, k: int, now: int) -> int:
        released = 0
        held = u.held
        while held and released < k:
            r = heapq.heappop(held)[2]
            if not is_held(r):
                continue  # finished or preempted while held
            rs = r.__dict__[ATTR]
            rs.held = False
            u.m.unhold(rs.held_since, now)
            del self._held[r]
            u.n_held -= 1
            self.running.append(r)
            released += 1
        self.stats["released"] += released
        if released and self._trace is not None:
            self._tr_released[u.key] = self._tr_released.get(u.key, 0) + released
        return released

    def _release_all(self) -> None:
        now = self._clock()
        for u in self._users.values():
            if u.n_held:
                self._release_user(u, u.n_held, now)
            u.armed = False
        self._wake.clear()

    def _displace(self, now: int) -> None:
        """Fair admission: when every resident slot is taken, a waiting request
        of a user with budget displaces a held request of the user holding the
        most slots (preempted and requeued; prefix cache keeps what it can).
        At most one per step, after a bounded scan of the queue head."""
        limiter = self.limiter
        for i, r in enumerate(self.waiting):  # type: ignore[attr-defined]
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
            victim_user = max(
                (v for v in self._users.values() if v.n_held),
                key=lambda v: v.resident,
                default=None,
            )
            if victim_user is None or victim_user.resident <= u.resident + 1:
                return  # slots are already shared fairly
            self._preempt_request(self._youngest_held(victim_user), time.monotonic())
            self.stats["displaced"] += 1
            self.metrics.displaced += 1
            return

    def _youngest_held(self, u: UserState) -> Request:
        return max(
            (e for e in u.held if is_held(e[2])),
            key=lambda e: (e[0], e[1]),
        )[2]

    def _swap_policy(self, policy: CompiledPolicy, now: int) -> None:
        self.limiter.set_policy(policy)
        logger.debug("outrate: scheduler switched to %s", policy.summary())
        self._wake.clear()
        for u in self._users.values():
            u.armed = False
            if u.n_held:
                self._arm(u, now)
            self._relabel(u, policy)
        if self._trace is not None:
            self._trace.event(now, policy=policy.sha256, source=policy.source)

    def _relabel(self, u: UserState, policy: CompiledPolicy) -> None:
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

    # -- engine loop --------------------------------------------------------

    def outrate_idle_wait_ns(self) -> int:
        """How long the engine may block on its input queue after a step that
        ran nothing: until the earliest throttled user is ready, at most 50 ms.
        0 when no throttling explains the idle step (stock behaviour)."""
        if getattr(self, "_pause_state", PauseState.UNPAUSED) != PauseState.UNPAUSED:
            return 0
        earliest = 0
        while self._wake:
            ready, _, u = self._wake[0]
            if u.wakes_at(ready):
                earliest = ready
                break
            heapq.heappop(self._wake)
        if self._blocked_ready and (earliest == 0 or self._blocked_ready < earliest):
            earliest = self._blocked_ready
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
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    cls = (
        OutrateAsyncScheduler if vllm_config.scheduler_config.async_scheduling else OutrateScheduler
    )
    return cls(*args, **kwargs)
