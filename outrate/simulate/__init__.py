"""`outrate simulate`: what a policy and an engine configuration do to each
user, before they are deployed. The vLLM-free parts live here: the workload
file (`workload`, `values`), the requests it sends (`plan`), the step-time
model (`stepmodel`) and its calibration from a trace (`tracefit`) or from vLLM's
counters on /metrics (`counters`, `metricsfit`), the engine flags
(`engine`), what a run records (`record`) and reports (`report`), the
figures (`plot`), one question asked once, side by side or as a sweep
(`study`), and the commands (`commands`). The run itself is vLLM's own
scheduler with outrate's, on a virtual clock: vllm_integration/offline/simulator.py."""

from outrate.simulate.engine import EngineSpec, engine_from_flags
from outrate.simulate.report import RunResult, UserStats
from outrate.simulate.stepmodel import StepModel, load_step_model
from outrate.simulate.tracefit import Calibration, calibrate
from outrate.simulate.workload import (
    LoadedWorkload,
    Workload,
    WorkloadError,
    load_workload,
    parse_workload,
    workload_json_schema,
)

__all__ = [
    "Calibration",
    "EngineSpec",
    "LoadedWorkload",
    "RunResult",
    "StepModel",
    "UserStats",
    "Workload",
    "WorkloadError",
    "calibrate",
    "engine_from_flags",
    "load_step_model",
    "load_workload",
    "parse_workload",
    "workload_json_schema",
]
