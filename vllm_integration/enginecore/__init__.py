"""The engine-core process around the steps: `outrate_scheduler`, the
`--scheduler-cls` target (it builds the scheduler, then `wire_engine` loads
the settings and the policy, opens the store and starts the threads), the
engine-loop wait (`wiring`), the background threads (`threads`: reload,
metrics, trace) and the store's lease thread (`store`)."""

from vllm_integration.enginecore.wiring import build, outrate_scheduler, wire_engine

__all__ = ["build", "outrate_scheduler", "wire_engine"]
