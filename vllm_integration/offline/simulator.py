"""`outrate simulate`: vLLM's own scheduler and outrate's, on a virtual clock.

What runs is the real thing: vLLM 0.32's `Scheduler` (or `AsyncScheduler`)
with outrate's subclass, vLLM's KV cache manager and block pool, the policy
loaded and compiled by the path the engine uses (`wire_engine` reads it from
`additional_config`, checks the deployment, compiles it). Held requests,
displacement, `max_streams`, refunds and KV preemption happen as in the
engine, because they are the engine's code. Two things are fabricated: the
model's output (one token per sampled request, `ignore_eos`) and time: each
step lasts what the step-time model says (outrate.simulate.stepmodel), and
the clock the limiter reads is the virtual one.

The loop is the engine core's: requests that arrived join at a step
boundary; a step is scheduled, "runs" for its modelled length, and its
output is applied (async: one step behind, as `step_with_batch_queue`
does). A step that schedules nothing waits like the engine: on outrate's
idle wait (`outrate_idle_wait_ns`, until the earliest throttled user is
ready, at most 50 ms), or 1 ms when requests exist that no throttling
explains (vLLM's own loop), or until the next arrival when idle. Any new
arrival ends a wait at once, as a request on the input queue does. The
first step after such a wait adds the model's wake cost for a wait that
long (`StepModel.wake_share`), and a step its cost for each request it
held (`StepModel.per_held_us`).

The model directory is only a `config.json` (no weights, no tokenizer):
the scheduler needs the model's length, nothing else.
"""

from __future__ import annotations

import atexit
import heapq
import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outrate.errors import OutrateError
from outrate.simulate.engine import EngineSpec, max_model_len_for
from outrate.simulate.plan import RequestSpec, Stream, plan
from outrate.simulate.record import Recorder
from outrate.simulate.report import RunResult
from outrate.simulate.stepmodel import StepModel
from outrate.simulate.workload import Workload

START_NS = 1_000 * 1_000_000_000
"""The virtual clock's start (not 0: outrate reads 0 as "no time")."""
BUSY_LOOP_NS = 1_000_000
"""vLLM's engine loop sleeps 1 ms when requests exist and none can run."""
WAITED_AT_START_NS = 10**12
"""The first step finds the engine idle for long: all of the wake cost."""
TOKEN = 7
"""The token every fabricated step samples (requests ignore EOS anyway)."""
PROGRESS_EVERY_S = 0.25
"""How often (wall time) a long run reports its progress."""

Progress = Callable[[int, int], None]
"""Called with (simulated ns so far, requests finished) during a run."""

_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
_model_dirs: dict[int, str] = {}


def _model_dir(max_model_len: int) -> str:
    """A directory holding only a Llama `config.json` of this length."""
    found = _model_dirs.get(max_model_len)
    if found is None:
        found = tempfile.mkdtemp(prefix="outrate-sim-model-")
        atexit.register(shutil.rmtree, found, ignore_errors=True)
        config = {**_MODEL_CONFIG, "max_position_embeddings": max_model_len}
        Path(found, "config.json").write_text(json.dumps(config))
        _model_dirs[max_model_len] = found
    return found


class VirtualClock:
    """What the limiter reads instead of CLOCK_MONOTONIC."""

    def __init__(self, now: int = START_NS) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def build_scheduler(
    engine: EngineSpec, policy: str | os.PathLike[str] | None, max_model_len: int
) -> Any:
    """The scheduler the engine would build for `engine`, with the policy
    file (None: vLLM's stock scheduler)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_integration.common.settings import CONFIG_KEY, EngineSettings
    from vllm_integration.enginecore import build
    from vllm_integration.step import OutrateAsyncScheduler, OutrateScheduler

    logging.getLogger("vllm").setLevel(logging.WARNING)
    mc = ModelConfig(
        model=_model_dir(max_model_len),
        dtype="bfloat16",
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
        enforce_eager=True,
    )
    sc = SchedulerConfig(
        max_num_seqs=engine.max_num_seqs,
        max_num_active_seqs=engine.max_num_active_seqs,
        max_num_batched_tokens=engine.batched_tokens(max_model_len),
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=engine.chunked_prefill,
        policy="priority" if engine.scheduling_policy == "priority" else "fcfs",
        async_scheduling=engine.async_scheduling,
    )
    cc = CacheConfig(block_size=engine.block_size, enable_prefix_caching=engine.prefix_caching)
    settings = None
    if policy:  # what the API server sends the engine core, without reloads
        settings = EngineSettings(policy=os.path.abspath(policy), reload="off").to_config()
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        additional_config={CONFIG_KEY: settings} if settings else {},
    )
    blocks = engine.blocks_for(max_model_len)
    vc.cache_config.num_gpu_blocks = blocks
    spec = FullAttentionSpec(
        block_size=engine.block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )
    kv = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    args: dict[str, Any] = {
        "vllm_config": vc,
        "kv_cache_config": kv,
        "block_size": engine.block_size,
        "structured_output_manager": StructuredOutputManager(vc),
        "log_stats": False,
    }
    if policy:  # built and wired as the engine does (`--scheduler-cls`)
        return build(OutrateAsyncScheduler if engine.async_scheduling else OutrateScheduler, **args)
    return (AsyncScheduler if engine.async_scheduling else Scheduler)(**args)


class Simulation:
    """One run of a workload through one scheduler."""

    def __init__(
        self,
        workload: Workload,
        engine: EngineSpec,
        policy: str | os.PathLike[str] | None,
        step_model: StepModel,
        label: str = "",
        trace: str | os.PathLike[str] | None = None,
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.workload = workload
        self.engine = engine
        self.step_model = step_model
        self.label = label
        self.max_model_len = max_model_len_for(engine, workload.longest_request())
        self.sched = build_scheduler(engine, policy, self.max_model_len)
        self.clock = VirtualClock()
        self.outrate = policy is not None
        if self.outrate:  # the engine wired it with the wall clock: the virtual one
            # The step model is the scheduler's prior too: lending by step time
            # (vllm_integration/step/steptime.py) starts from the clock's own costs.
            self.sched.outrate_configure(
                self.sched.policy_box.current, clock=self.clock, step_model=step_model
            )
        self.trace = None
        if trace is not None:  # the engine's own trace, stamped with the virtual clock
            if not self.outrate:
                raise ValueError("a trace needs a policy: vLLM's stock scheduler writes none")
            from outrate.observe.trace import TraceWriter

            self.trace = TraceWriter(os.fspath(trace), header={"simulated": True})
            self.sched.outrate_trace(self.trace)
            self.trace.start()
        init_none_hash(sha256)
        self.hasher = (
            get_request_block_hasher(engine.block_size, sha256) if engine.prefix_caching else None
        )
        self.plan = plan(workload)
        self.turnaround_ns = int(step_model.turnaround_us * 1000)
        self.rec = Recorder(self.plan.users, START_NS)
        self.live: dict[str, tuple[Any, Stream | None]] = {}
        self.arrivals: list[tuple[int, int, RequestSpec, Stream | None]] = []
        self._seq = 0
        self._deferred_seen: dict[str, str] = {}
        self._deferred_total = 0
        self._holds_total = 0
        self.partial = ""

    # -- arrivals ----------------------------------------------------------------

    def _push(self, t: int, spec: RequestSpec, stream: Stream | None) -> None:
        self._seq += 1
        heapq.heappush(self.arrivals, (t, self._seq, spec, stream))

    def _admit_arrived(self) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        now = self.clock.now
        while self.arrivals and self.arrivals[0][0] <= now:
            t, _, spec, stream = heapq.heappop(self.arrivals)
            if len(spec.prompt) >= self.max_model_len:  # vLLM answers 400; say so here
                raise OutrateError(
                    f"{spec.user}: a prompt of {len(spec.prompt)} tokens does not fit "
                    f"--max-model-len {self.max_model_len}"
                )
            sp = SamplingParams(
                max_tokens=min(spec.output, self.max_model_len - len(spec.prompt)),
                ignore_eos=True,
                extra_args={"output_rate_user": spec.user},
            )
            req = Request(
                request_id=spec.id,
                prompt_token_ids=spec.prompt,
                sampling_params=sp,
                pooling_params=None,
                arrival_time=t / 1e9,
                priority=spec.priority,
                block_hasher=self.hasher,
            )
            self.live[spec.id] = (req, stream)
            self.rec.arrived(spec.id, spec.user, t)
            self.sched.add_request(req)

    # -- the loop ----------------------------------------------------------------

    def run(self, progress: Progress | None = None) -> RunResult:
        """The whole workload, or up to Ctrl-C: then the figures of what was
        simulated so far, marked partial."""
        started = time.perf_counter()
        try:
            end = self._loop(progress, started)
        except KeyboardInterrupt:
            end = self.clock.now
            done = (end - START_NS) / 1e9
            self.partial = f"stopped at {done:.3g}s of {self.plan.duration_ns / 1e9:g}s simulated"
        return self._result(max(end, START_NS + 1), time.perf_counter() - started)

    def _loop(self, progress: Progress | None, started: float) -> int:
        """The engine core's loop until the workload's end; returns the end."""
        for s in self.plan.streams:
            if s.first_ns < s.stop_ns:
                self._push(START_NS + s.first_ns, s.next_request(), s)
        for t, spec in self.plan.arrivals:
            self._push(START_NS + t, spec, None)
        end = START_NS + self.plan.duration_ns
        sched, clock, model = self.sched, self.clock, self.step_model
        kvm = sched.kv_cache_manager
        pending: deque[tuple[Any, list[str]]] = deque()
        behind = 1 if self.engine.async_scheduling else 0
        report_at = started + PROGRESS_EVERY_S
        n = 0
        waited_ns = WAITED_AT_START_NS  # the engine starts from idle
        while clock.now < end:
            n += 1
            if progress is not None and n % 256 == 0 and time.perf_counter() >= report_at:
                progress(clock.now - START_NS, self.rec.finished_count)
                report_at = time.perf_counter() + PROGRESS_EVERY_S
            self._admit_arrived()
            now = clock.now
            out = sched.schedule()
            scheduled: dict[str, int] = out.num_scheduled_tokens
            self._count_deferrals()
            held, holds = self._held(), self._holds()
            if not scheduled:
                while pending:
                    self._apply(*pending.popleft(), now)
                self._apply(out, [], now)
                wake = self._idle_until(now, end)
                self.rec.step(now, wake - now, 0, kvm.usage, held, len(sched.waiting), False)
                clock.now = wake
                waited_ns += wake - now
                continue
            requests = sched.requests
            decode = self._count_prompts(scheduled, requests, now)
            prefill = out.total_num_scheduled_tokens - decode
            dt = model.step_ns(decode, prefill, waited_ns / 1000, holds)
            waited_ns = 0
            samplers = [r for r in scheduled if not requests[r].is_prefill_chunk]
            pending.append((out, samplers))
            clock.now = now + dt
            if len(pending) > behind:
                self._apply(*pending.popleft(), clock.now)
            self.rec.step(now, dt, len(scheduled), kvm.usage, held, len(sched.waiting), True)
        return end

    def _count_prompts(self, scheduled: dict[str, int], requests: dict[str, Any], now: int) -> int:
        """Each user's prompt positions computed in the step dispatched at
        `now` (stock advanced `num_computed_tokens` at dispatch); returns the
        requests scheduled one token (the step model's `decode`: a one-token
        chunk costs what a decode does, one query position, as the engine's
        online fit prices it too, steptime.py)."""
        decode = 0
        per_user: dict[str, int] = {}
        of = self.rec.requests
        for rid, n in scheduled.items():
            if n == 1:
                decode += 1
            req = requests[rid]
            p = req.num_prompt_tokens
            start = req.num_computed_tokens - n
            if start < p:
                end = req.num_computed_tokens
                k = (end if end < p else p) - start
                user = of[rid].user
                per_user[user] = per_user.get(user, 0) + k
        for user, k in per_user.items():
            self.rec.prompt(user, now, k)
        return decode

    def _idle_until(self, now: int, end: int) -> int:
        """When a step that ran nothing is followed by the next one."""
        nxt = self.arrivals[0][0] if self.arrivals else end
        wait = self.sched.outrate_idle_wait_ns() if self.outrate else 0
        if wait > 0:
            return min(now + wait, nxt, end)
        if self.sched.has_requests():
            return min(now + BUSY_LOOP_NS, nxt, end)
        return min(nxt, end)

    def _apply(self, out: Any, samplers: list[str], t: int) -> None:
        """The fabricated model output of `out`, at `t` (its step's end)."""
        from vllm_integration.offline.outputs import model_runner_output

        ids = list(out.num_scheduled_tokens)
        sampled = set(samplers)
        mro = model_runner_output(ids, [[TOKEN] if r in sampled else [] for r in ids])
        outputs = self.sched.update_from_output(out, mro)
        rec = self.rec
        for eco in outputs.values():
            for o in eco.outputs:
                if o.new_token_ids:
                    rec.sampled(o.request_id, len(o.new_token_ids), t)
                if o.finish_reason is not None:
                    self._finished(o.request_id, t)

    def _finished(self, rid: str, t: int) -> None:
        req, stream = self.live.pop(rid)
        self._deferred_seen.pop(rid, None)
        self.rec.finished(rid, t, req.num_preemptions)
        if stream is not None:
            nxt = t + stream.think_ns() + self.turnaround_ns
            if nxt < START_NS + stream.stop_ns:
                self._push(nxt, stream.next_request(), stream)

    def _held(self) -> dict[str, int]:
        if not self.outrate or not self.sched.n_held:
            return {}
        return {u.key: u.n_held for u in self.sched._users.values() if u.n_held}

    def _holds(self) -> int:
        """Requests the step just scheduled held (outrate's hold counter moved)."""
        if not self.outrate:
            return 0
        before, self._holds_total = self._holds_total, self.sched.metrics.holds
        return max(self._holds_total - before, 0)

    def _count_deferrals(self) -> None:
        """Admissions deferred this step, per user: counted like outrate's
        metric (once per deferral), found when its total moved."""
        if not self.outrate:
            return
        total = sum(self.sched.metrics.deferred.values())
        if total == self._deferred_total:
            return
        self._deferred_total = total
        seen = self._deferred_seen
        for r in self.sched.waiting:
            rs = r.__dict__.get("_outrate")
            if rs is not None and rs.deferred and seen.get(r.request_id) != rs.deferred:
                seen[r.request_id] = rs.deferred
                self.rec.deferral(rs.user.key)

    def _result(self, end: int, wall_s: float) -> RunResult:
        still = sum(req.num_preemptions for req, _ in self.live.values())
        if self.outrate:
            self.rec.displaced = self.sched.metrics.displaced
        result = self.rec.result(end, self.label, still_preempted=still)
        result.wall_s = wall_s
        result.partial = self.partial
        result.prompt_limited = self.outrate and bool(self.sched.policy_box.current.prompt_rules)
        result.meta = {
            "engine_config": self.engine.describe(),
            "step_model": self.step_model.to_json(),
            "max_model_len": self.max_model_len,
        }
        if self.trace is not None:
            self.trace.stop()
        if self.outrate:
            self.sched.shutdown()
        return result


def simulate(
    workload: Workload,
    engine: EngineSpec,
    policy: str | os.PathLike[str] | None,
    step_model: StepModel,
    label: str = "",
    trace: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Run `workload` through the scheduler `engine` and `policy` make (None:
    stock vLLM) and return what each user and the engine saw. `trace`: also
    write the scheduler's `--outrate-trace` of the run there; `progress`:
    called now and then with (simulated ns, requests finished)."""
    return Simulation(workload, engine, policy, step_model, label, trace).run(progress)
