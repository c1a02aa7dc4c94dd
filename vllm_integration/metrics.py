"""Engine-side metrics on vLLM's own `/metrics` (API-server side).

The scheduler counts in the engine-core process and its publisher thread
writes a JSON snapshot into a directory (outrate.metrics). Here, in the API
server, before the engine core is started: create that directory (the engine
core learns it from `additional_config`), and register a collector that reads
the newest snapshot on each scrape.

Patches vLLM 0.32's `vllm.entrypoints.serve.instrumentator.metrics.
get_prometheus_registry` (the registry `/metrics` serves): the collector is
added to whatever registry vLLM picks, the global one or, in Prometheus
multiprocess mode, the per-app one. Can go when vLLM has a way for plugins to
export engine-core metrics (its `SchedulerStats` has no field for them).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any

from outrate.metrics import SnapshotCollector

_collector: SnapshotCollector | None = None


def install_metrics() -> str:
    """Create the snapshot directory and serve it on /metrics; idempotent.
    Returns the directory for the engine core."""
    global _collector
    if _collector is not None:
        return _collector.directory
    directory = tempfile.mkdtemp(prefix="outrate-metrics-")
    atexit.register(shutil.rmtree, directory, True)
    _collector = SnapshotCollector(directory)
    from prometheus_client import REGISTRY

    REGISTRY.register(_collector)
    try:
        from vllm.entrypoints.serve.instrumentator import metrics as instrumentator
    except ImportError:  # another vLLM layout: the global registry is all we have
        return directory
    stock = getattr(instrumentator, "get_prometheus_registry")  # noqa: B009 - not re-exported

    def get_prometheus_registry() -> Any:
        registry = stock()
        if registry is not REGISTRY:
            registry.register(_collector)
        return registry

    setattr(instrumentator, "get_prometheus_registry", get_prometheus_registry)  # noqa: B010
    return directory
