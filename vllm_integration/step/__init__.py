"""What runs in every scheduler step: the rate-limited `Scheduler` and
`AsyncScheduler` (`scheduler`), and the plain-Python machinery they drive:
`Holdback` (held requests, wake-ups), `Admission` (deferral, displacement),
`Ledger` (each token's count, refunds), `Roster` (users with live requests),
the records of `state`, `HeldFirstAllocation` (KV victims: `kv`) and the
trace's `StepRecorder`. Imports neither the startup nor the API server code."""

from vllm_integration.step.scheduler import (
    IDLE_WAIT_MAX_NS,
    OutrateAsyncScheduler,
    OutrateMixin,
    OutrateScheduler,
)

__all__ = ["IDLE_WAIT_MAX_NS", "OutrateAsyncScheduler", "OutrateMixin", "OutrateScheduler"]
