"""Engine-side metrics on vLLM's own `/metrics` (API-server side).

The scheduler counts in the engine-core process and its publisher thread
writes a JSON snapshot into a directory (outrate.observe.metrics). Here, in the API
server, before the engine core is started: create that directory (the engine
core learns it from `additional_config`), and register a collector that reads
the newest snapshot on each scrape.

Patches vLLM 0.32's `vllm.entrypoints.serve.instrumentator.metrics.
get_prometheus_registry` (the registry `/metrics` serves): the collector is
added to the registry vLLM picks. In Prometheus multiprocess mode (vLLM turns
it on with `--api-server-count > 1`) /metrics is answered by the
instrumentator from a registry it makes per scrape, holding one
`MultiProcessCollector` and nothing else: that class's `collect` yields
outrate's families after its own (and the per-app registry, which holds one
too, does not get the collector a second time). Each API-server process vLLM
spawns installs this from the plugin's `register()`, reading the directory its
parent made (`DIR_ENV`). Tested on a real server in
tests/test_e2e_api_servers.py. Can go when vLLM has a way for plugins to
export engine-core metrics (its `SchedulerStats` has no field for them).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

from outrate.env import METRICS_DIR, Env
from outrate.observe.publish import SnapshotCollector

_collector: SnapshotCollector | None = None

DIR_ENV = METRICS_DIR
"""`<pid>:<directory>`, set by the process that made the directory. With
`--api-server-count N > 1` vLLM spawns N API-server processes; each must
read the directory the engine core writes (`install_in_spawned_api_server`),
not make one of its own."""


def _parents_directory() -> str | None:
    """The directory our parent made, if it made one (a variable inherited from
    further up, or left in a shell, belongs to another server)."""
    pid, _, directory = Env.read().metrics_dir.partition(":")
    if pid == str(os.getppid()) and os.path.isdir(directory):
        return directory
    return None


def install_in_spawned_api_server() -> None:
    """In an API-server process vLLM spawned (`--api-server-count > 1`, process
    name `ApiServer_<i>`): serve the directory our parent made. Runs from the
    plugin's `register()`, which vLLM calls there before it builds the app and
    mounts /metrics (the flags are parsed there before the plugin is loaded,
    so `apply_outrate_args` never runs in such a process)."""
    import multiprocessing

    if multiprocessing.current_process().name.startswith("ApiServer_"):
        directory = _parents_directory()
        if directory is not None:
            install_metrics(directory)


def install_metrics(directory: str | None = None) -> str:
    """Serve `directory` on /metrics, or a new one this process makes (the
    process that parses the flags: never a directory it inherited, which
    another server may be writing); idempotent. Returns the directory for
    the engine core."""
    global _collector
    if _collector is not None:
        return _collector.directory
    if directory is None:
        directory = tempfile.mkdtemp(prefix="outrate-metrics-")
        atexit.register(shutil.rmtree, directory, True)  # only its maker removes it
        os.environ[DIR_ENV] = f"{os.getpid()}:{directory}"  # for the API servers it spawns
    collector = _collector = SnapshotCollector(directory)
    from prometheus_client import REGISTRY, multiprocess

    REGISTRY.register(collector)
    # Multiprocess mode (vLLM sets PROMETHEUS_MULTIPROC_DIR with more than one
    # API server): /metrics is served by the instrumentator from a registry it
    # makes per scrape, holding one MultiProcessCollector and nothing else.
    stock_collect: Any = multiprocess.MultiProcessCollector.collect

    def collect(self: Any) -> Any:
        yield from stock_collect(self)
        yield from collector.collect()

    multiprocess.MultiProcessCollector.collect = collect  # type: ignore[method-assign]
    from vllm_integration.common.compat import owner_of

    instrumentator = owner_of("get_prometheus_registry")
    stock = getattr(instrumentator, "get_prometheus_registry")  # noqa: B009 - not re-exported

    def get_prometheus_registry() -> Any:
        registry = stock()
        if registry is not REGISTRY and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry.register(collector)  # a multiprocess one has it already (above)
        return registry

    setattr(instrumentator, "get_prometheus_registry", get_prometheus_registry)  # noqa: B010
    return directory


# -- the API server's own counters -------------------------------------------

REFUSED = (
    "outrate_requests_refused",
    "Requests refused with HTTP 429 in the API server, before tokenization.",
)
SHADOW_OVER = (
    "outrate_shadow_requests_over_limit",
    "Requests over a request rate in shadow: counted, not refused.",
)
API_SERVER_COUNTERS = (REFUSED, SHADOW_OVER)
"""(name, help) of the counters this process keeps itself, both labelled
`limit` and `reason` (`requests` or `quota`): what /metrics shows as NAME_total."""

_refused: Any = None
_shadow_over: Any = None


def count_requests_over(label: str, reason: str, shadow: bool) -> None:
    """One request over its user's rate or quota (`reason`): refused (429),
    or in shadow counted and let through. Counted in this API-server process with
    prometheus_client (multiprocess files when vLLM runs several, summed on
    /metrics); created on first use, after vLLM set its multiprocess
    directory."""
    global _refused, _shadow_over
    from prometheus_client import Counter

    if shadow:
        if _shadow_over is None:
            _shadow_over = Counter(*SHADOW_OVER, ["limit", "reason"])
        _shadow_over.labels(label, reason).inc()
        return
    if _refused is None:
        _refused = Counter(*REFUSED, ["limit", "reason"])
    _refused.labels(label, reason).inc()
