"""The scheduler's engine-core wiring: `outrate_scheduler`, the
`--scheduler-cls` target vLLM calls to build the scheduler, which builds it
and then wires it (`wire_engine`); and the engine-loop patch: wait on the
input queue instead of spinning when every request is throttled.

vLLM 0.32's `EngineCoreProc._process_engine_step` sleeps 1 ms and loops when
no model ran but requests exist: a busy spin while everyone is throttled.
After such a step we block on the engine's input queue for
`scheduler.outrate_idle_wait_ns()` (at most 50 ms, until the earliest user is
ready), so a new request or an abort wakes the engine at once and nothing
sleeps inside `schedule()`. Only acts when the scheduler is outrate's.
Can go when vLLM lets a scheduler report how long it has nothing to do.
"""

from __future__ import annotations

import logging
import queue
from typing import Any

logger = logging.getLogger("vllm.outrate")


def outrate_scheduler(*args: Any, **kwargs: Any) -> Any:
    """`--scheduler-cls` target: picks the variant vLLM itself would pick, once
    this vLLM's scheduler is checked to have every method outrate overrides,
    with the same parameters (compat.check_overrides), and wires it."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_integration.common.compat import check_overrides
    from vllm_integration.step.scheduler import (
        OutrateAsyncScheduler,
        OutrateMixin,
        OutrateScheduler,
    )

    check_overrides(OutrateMixin, Scheduler)
    vllm_config: Any = kwargs.get("vllm_config", args[0] if args else None)
    async_ = vllm_config.scheduler_config.async_scheduling
    return build(OutrateAsyncScheduler if async_ else OutrateScheduler, *args, **kwargs)


def build(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """An outrate scheduler of class `cls`, built by vLLM's constructor, then
    wired (`wire_engine`): what the engine, the simulator and the tests build."""
    sched = cls(*args, **kwargs)
    sched.outrate_threads = wire_engine(sched)
    return sched


def wire_engine(sched: Any) -> Any:
    """The engine core put together, in one place and in order, at the
    scheduler's construction: the settings the API server sent (after the
    deployment rules and the connectors the scheduler was built with), the
    policy they name (refused if it has prompt limits this engine cannot
    enforce), the budget store (`--outrate-store`), the scheduler's parts,
    then the threads (reload, metrics, trace, leases) and the idle
    wait. Returns the `EngineThreads`."""
    from vllm_integration.common.config import (
        compile_settings,
        refuse_connectors,
        refuse_prompt_limits,
        refuse_quotas,
        settings_from_vllm_config,
    )
    from vllm_integration.enginecore.store import open_store
    from vllm_integration.enginecore.threads import start_engine_threads

    refuse_connectors(sched)
    settings = settings_from_vllm_config(sched.vllm_config)
    policy = compile_settings(settings)
    chunked = bool(sched.scheduler_config.enable_chunked_prefill)
    refuse_prompt_limits(policy, bool(settings.store), chunked, sched.max_model_len)
    refuse_quotas(
        policy, bool(settings.store), settings.quota_file, settings.data_parallel_size or 1
    )
    store = open_store(policy, settings, sched.vllm_config)
    if store is None:
        sched.outrate_configure(policy)
    else:
        sched.outrate_configure(policy, limiter=store.limiter, prompt_table=store.prompts)
    logger.info("outrate: %s", policy.summary())
    if policy.shadow_rules:
        logger.info("outrate: shadow (counted, not enforced): %s", ", ".join(policy.shadow_rules))
    threads = start_engine_threads(sched, settings, store)
    install_idle_wait()
    return threads


def install_idle_wait() -> None:
    """Patch `EngineCoreProc._process_engine_step` once per process."""
    from vllm_integration.common.compat import owner_of

    EngineCoreProc = owner_of("EngineCoreProc._process_engine_step")
    if getattr(EngineCoreProc, "_outrate_idle_wait", False):
        return
    stock = EngineCoreProc._process_engine_step

    def _process_engine_step(self: Any) -> bool:
        executed = stock(self)
        if not executed:
            wait_ns = getattr(self.scheduler, "outrate_idle_wait_ns", None)
            ns = wait_ns() if wait_ns is not None else 0
            if ns > 0:
                try:
                    req = self.input_queue.get(timeout=ns / 1e9)
                except queue.Empty:
                    pass
                else:
                    self._handle_client_request(*req)
        return bool(executed)

    EngineCoreProc._process_engine_step = _process_engine_step
    EngineCoreProc._outrate_idle_wait = True
