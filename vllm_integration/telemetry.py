"""The engine core's telemetry threads: the metrics publisher and the token trace.

Started by the scheduler from its settings (`additional_config["outrate"]`):
`metrics_dir` (set by the plugin in the API server, which reads the snapshots
back on every `/metrics` scrape) and `trace` / `trace_max_bytes`
(`--outrate-trace`). Both write from their own daemon threads; the scheduler
thread only counts.
"""

from __future__ import annotations

import logging
from typing import Any

from outrate.metrics import Publisher, snapshot
from outrate.trace import DEFAULT_MAX_BYTES, TraceWriter

logger = logging.getLogger("vllm.outrate")


class Telemetry:
    def __init__(self, publisher: Publisher | None, trace: TraceWriter | None) -> None:
        self.publisher = publisher
        self.trace = trace

    def stop(self) -> None:
        if self.trace is not None:
            self.trace.stop()
        if self.publisher is not None:
            self.publisher.stop()


def start_telemetry(scheduler: Any, settings: dict[str, Any]) -> Telemetry:
    publisher = trace = None
    if settings.get("trace"):
        policy = scheduler.limiter.policy
        trace = TraceWriter(
            settings["trace"],
            header={
                "policy": policy.sha256,
                "source": policy.source,
                "burst_ns": policy.burst_ns,
            },
            max_bytes=int(settings.get("trace_max_bytes") or DEFAULT_MAX_BYTES),
            logger=logger,
        )
        scheduler._trace = trace
        trace.start()
        logger.info("outrate: writing the token trace to %s", settings["trace"])
    if settings.get("metrics_dir"):

        def take() -> dict[str, Any]:
            reloader = getattr(scheduler, "_reloader", None)
            if reloader is not None:
                scheduler.metrics.reloads = {
                    "applied": reloader.applied,
                    "rejected": reloader.rejected,
                }
            return snapshot(scheduler.metrics, scheduler.policy_box.current)

        publisher = Publisher(settings["metrics_dir"], take, logger=logger)
        publisher.publish()  # /metrics shows the policy before the first request
        publisher.start()
    return Telemetry(publisher, trace)
