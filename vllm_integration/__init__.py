"""outrate's vLLM integration: the only package that imports vLLM.

Grouped by where each piece runs:

- `step/`: inside every scheduler step (the scheduler subclasses and the
  machinery they drive: holdback, admission, ledger, roster, state, KV
  victims, the trace recorder). It imports neither the startup nor the API
  server code (an import-linter contract).
- `enginecore/`: in the engine-core process, beside the steps: the scheduler
  factory vLLM calls, the engine wiring and the engine-loop wait, and the
  background threads (reload, metrics, trace, store leases).
- `apiserver/`: in the API server process: request guards, identity, the
  engine's metrics on `/metrics`.
- `startup/`: when a process starts: the plugin entry points, `outrate
  serve`'s launcher, the flag lists, the CPU platform fixes, `outrate doctor`.
- `common/`: what every process reads: the settings record sent from the API
  server to the engine core, vLLM's configuration turned into outrate's, which
  vLLM this is (`versions`), and the patch index (`patches.PATCHES`, with
  `compat.locate` finding each target).
- `offline/`: `outrate simulate`'s engine on a virtual clock, and the model
  outputs it fabricates (also for the tests and benchmarks).
"""
