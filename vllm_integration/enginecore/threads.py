"""The engine core's background threads, started with the scheduler.

From the `EngineSettings` the API server sent:
- the policy `Reloader` (`--outrate-reload`, default watch): publishes each
  new policy into the scheduler's `PolicyBox`, read at the next step;
- the metrics `Publisher` (`metrics_dir`, set by the plugin in the API
  server, which serves the snapshots on /metrics);
- the `TraceWriter` (`--outrate-trace`);
- the store's lease thread (`--outrate-store`, vllm_integration/enginecore/store.py),
  whose counts go into the metrics snapshot;
- the `QuotaSaver` (`--outrate-quota-file`), whose book's usage goes into
  the metrics snapshot too.
Each writes from its own daemon thread; the scheduler thread only counts.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from outrate.budget.quota import QuotaBook
from outrate.budget.quotafile import QuotaSaver
from outrate.observe.publish import Publisher, snapshot
from outrate.observe.quotas import QuotaGauges
from outrate.observe.trace import DEFAULT_MAX_BYTES, TraceWriter
from outrate.policy.compiler import CompiledPolicy
from outrate.policy.reload import Reloader
from vllm_integration.common.settings import EngineSettings, dp_suffix, rank_path
from vllm_integration.common.versions import is_supported, vllm_version
from vllm_integration.enginecore.store import Store

logger = logging.getLogger("vllm.outrate")


class EngineThreads:
    def __init__(self) -> None:
        self.reloader: Reloader | None = None
        self.publisher: Publisher | None = None
        self.trace: TraceWriter | None = None
        self.store: Store | None = None
        self.quota: QuotaSaver | None = None

    def stop(self) -> None:
        for thread in (self.reloader, self.store, self.trace, self.quota, self.publisher):
            if thread is not None:
                thread.stop()


def start_engine_threads(
    scheduler: Any, settings: EngineSettings, store: Store | None = None
) -> EngineThreads:
    threads = EngineThreads()
    box = scheduler.policy_box
    suffix = dp_suffix(getattr(scheduler, "vllm_config", None), settings)
    if store is not None:
        threads.store = store
        store.start(lambda: box.current.sha256)  # heartbeats the policy in force
    if settings.quota_file:
        book = QuotaBook()
        path = settings.quota_file

        def failed(e: Exception) -> None:
            logger.warning("outrate: cannot save quota usage to %s: %s", path, e)

        share = None
        if settings.store:  # the store holds usage; the file this engine's part of it
            from outrate.budget.shared.runner import TIMEOUT_S
            from outrate.budget.shared.usage import UsageLink

            share = UsageLink(settings.store, timeout_s=TIMEOUT_S)

        def told(line: str) -> None:
            logger.warning("outrate: %s", line)

        # (loads the saved usage)
        threads.quota = QuotaSaver(path, book, on_error=failed, share=share, on_share=told)
        scheduler.outrate_quotas(book)
        threads.quota.start()
        where = f"{path}, shared through {share.url}" if share is not None else path
        logger.info("outrate: quota usage in %s", where)
    if settings.reload != "off" and settings.policy is not None:
        from vllm_integration.common.config import (
            load_checked,
            refuse_prompt_limits,
            refuse_quotas,
        )

        sc = scheduler.scheduler_config
        chunked, max_len = bool(sc.enable_chunked_prefill), scheduler.max_model_len

        def load(path: str | os.PathLike[str]) -> CompiledPolicy:
            new = load_checked(path, settings.vllm_api_key)
            refuse_quotas(
                new, store is not None, settings.quota_file, settings.data_parallel_size or 1
            )
            return refuse_prompt_limits(new, store is not None, chunked, max_len)

        def publish(new: CompiledPolicy) -> None:
            box.current = new  # read by schedule() at the next step boundary

        threads.reloader = Reloader(
            settings.policy,
            publish,
            initial=box.current,
            mode=settings.reload,
            logger=logging.getLogger("vllm.outrate.reload"),
            loader=load,
        )
        threads.reloader.start()
    if settings.trace:
        policy = box.current
        path = rank_path(settings.trace, suffix)
        threads.trace = TraceWriter(
            path,
            header={"policy": policy.sha256, "source": policy.source, "burst_ns": policy.burst_ns},
            max_bytes=settings.trace_max_bytes or DEFAULT_MAX_BYTES,
            logger=logger,
        )
        scheduler.outrate_trace(threads.trace)
        threads.trace.start()
        logger.info("outrate: writing the token trace to %s", path)
    if settings.metrics_dir:
        version = vllm_version()
        vllm = {"version": version, "tested": is_supported(version)}

        gauges = None if threads.quota is None else QuotaGauges(threads.quota.book)

        def take() -> dict[str, Any]:
            reloader = threads.reloader
            reloads = None
            if reloader is not None:
                reloads = {"applied": reloader.applied, "rejected": reloader.rejected}
            lease = None if store is None else store.runner.metrics.snapshot()
            dropped = None if threads.trace is None else threads.trace.dropped_total
            quota = None if gauges is None else gauges.rows(scheduler.metrics, box.current)
            return snapshot(
                scheduler.metrics,
                box.current,
                reloads=reloads,
                store=lease,
                trace_dropped=dropped,
                vllm=vllm,
                quota=quota,
            )

        threads.publisher = Publisher(settings.metrics_dir, take, logger=logger, suffix=suffix)
        threads.publisher.publish()  # /metrics shows the policy before the first request
        threads.publisher.start()
    return threads
