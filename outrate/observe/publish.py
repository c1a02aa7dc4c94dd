"""The engine's metrics on their way to /metrics: a JSON snapshot of the
scheduler's counts (`snapshot`), written twice a second by the `Publisher`
thread (atomic rename), read, merged across data-parallel ranks and turned
into Prometheus families in the API server (`families`, `SnapshotCollector`).
Kept apart from the counting (metrics.py): the scheduler thread only counts;
everything here runs on other threads or in another process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from outrate.budget.gcra import PEAK_UNLIMITED
from outrate.budget.limiter import NS_PER_S, Limit
from outrate.budget.shared.metrics import merge_store, store_families
from outrate.histogram import add_json, cumulative
from outrate.observe.metrics import (
    BUCKETS_S,
    DEFERRED_REASONS,
    PUBLISH_INTERVAL_S,
    SNAPSHOT_FILE,
    LabelMetrics,
    Metrics,
    limit_of_label,
)
from outrate.observe.quotas import merge_quota
from outrate.policy.compiler import CompiledPolicy


def snapshot(
    metrics: Metrics,
    policy: CompiledPolicy,
    now: int | None = None,
    reloads: dict[str, int] | None = None,
    store: dict[str, Any] | None = None,
    trace_dropped: int | None = None,
    vllm: dict[str, Any] | None = None,
    quota: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A JSON-able picture of `metrics` (and of the reloader's counts, which
        live on the reloader, the budget store's, `StoreMetrics.snapshot()`,
        which live on the lease thread, and the trace writer's dropped lines,
        with `--outrate-trace`; and `vllm`, the version the engine runs on and
    whether outrate is tested on it; and `quota`, each label's quota usage,
    outrate.observe.quotas.quota_usage). Safe to call from another thread."""
    now = time.monotonic_ns() if now is None else now
    labels = {}
    for m in list(metrics.labels.values()):
        labels[m.label] = _row(m, limit_of_label(m.label, policy), now)
    empty = LabelMetrics("")
    rule_labels = ["default", "anonymous", *(f"tier:{t}" for t in policy.tiers)]
    rule_labels += [f"match:{p}" for p, _ in policy.patterns]
    for label in rule_labels:  # configured limits show before their first request
        if label not in labels:
            lim = limit_of_label(label, policy)
            labels[label] = _row(empty, lim, now)
    out: dict[str, Any] = {
        "pid": os.getpid(),
        "monotonic_ns": now,
        "policy": {"sha256": policy.sha256, "source": policy.source},
        "displaced": metrics.displaced,
        "lent": metrics.lent,
        "reclaimed": metrics.reclaimed,
        "deferred": dict(metrics.deferred),
        "reloads": reloads or {"applied": 0, "rejected": 0},
        "series": metrics.n_series,
        "labels": labels,
    }
    if store is not None:
        out["store"] = store
    if trace_dropped is not None:
        out["trace"] = {"dropped": trace_dropped}
    if vllm is not None:
        out["vllm"] = vllm
    if quota is not None:
        out["quota"] = quota
    return out


def _row(m: LabelMetrics, lim: Limit | None, now: int) -> dict[str, Any]:
    return {
        "tokens": m.tokens,
        "borrowed": m.borrowed,
        "shadow_over": m.shadow_over,
        "live": m.live,
        "held": m.held,
        "throttled_ns": m.throttled_total_ns(now),
        "wait": m.wait.to_json(),
        "interval": m.interval.to_json(),
        "rate": None if lim is None else (-1 if lim.rate is None else float(lim.rate)),
        "peak": None if lim is None else _peak(lim),
        "mode": None if lim is None else ("shadow" if lim.shadow else "enforce"),
        "prompt": m.prompt,
        "prompt_over": m.prompt_over,
        "prompt_waiting": m.prompt_waiting,
        "prompt_waits": m.prompt_waits,
        "prompt_rate": None if lim is None else _prompt_rate(lim),
        "prompt_borrowed": m.prompt_borrowed,
        "prompt_peak": None if lim is None else (-1 if lim.prompt is None else _peak(lim.prompt)),
    }


def _prompt_rate(lim: Limit) -> float:
    """The rule's prompt rate: -1 for unlimited (no `prompt`, or `prompt:
    unlimited`). Its mode is the rule's (a shadow rule's prompt limit is
    shadow too)."""
    prompt = lim.prompt
    return -1 if prompt is None or prompt.rate is None else float(prompt.rate)


def _peak(lim: Limit) -> float:
    """The most the limit lets through, borrowing included: -1 for unlimited (an
    unlimited rate, or `peak: unlimited`), the rate itself for a rule without
    a peak (it borrows nothing, so its peak is its rate)."""
    if lim.rate is None or lim.peak == PEAK_UNLIMITED:
        return -1
    return float(lim.rate if lim.peak is None else lim.peak)


def write_snapshot(path: str, data: dict[str, Any]) -> None:
    """Atomic: a scrape never sees half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


class Publisher:
    """Writes `snapshot()` to `directory/engine-metrics.json` every `interval_s`,
    from its own daemon thread (never the scheduler's), and once more on stop."""

    def __init__(
        self,
        directory: str,
        take: Callable[[], dict[str, Any]],
        interval_s: float = PUBLISH_INTERVAL_S,
        logger: logging.Logger | None = None,
        suffix: str = "",
    ) -> None:
        name = SNAPSHOT_FILE if not suffix else SNAPSHOT_FILE.replace(".json", f"{suffix}.json")
        self.path = os.path.join(directory, name)
        self._take = take
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outrate-metrics", daemon=True)
        self._logger = logger or logging.getLogger("vllm.outrate")
        self._failed = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.publish()

    def publish(self) -> None:
        try:
            write_snapshot(self.path, self._take())
            self._failed = False
        except Exception as e:  # never take the engine down for a metrics file
            if not self._failed:
                self._logger.warning("outrate: cannot write metrics to %s: %s", self.path, e)
            self._failed = True

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.publish()


# -- the API-server side: snapshot -> Prometheus families ----------------------


def read_snapshot(directory: str) -> dict[str, Any] | None:
    """The engines' newest snapshots, merged (data parallel: one per rank)."""
    snaps = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("engine-metrics"))
    except OSError:
        return None
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                snaps.append(json.load(f))
        except (OSError, ValueError):
            continue
    return merge_snapshots(snaps)


def merge_snapshots(snaps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One picture of several engines serving one API server (data
    parallel): counts and gauges per label add up; the store is up only if
    every engine sees it; the policy shown is the first engine's."""
    if not snaps:
        return None
    out: dict[str, Any] = json.loads(json.dumps(snaps[0]))
    for s in snaps[1:]:
        for k in ("displaced", "lent", "reclaimed"):
            out[k] = out.get(k, 0) + s.get(k, 0)
        for k, v in s.get("deferred", {}).items():
            out["deferred"][k] = out["deferred"].get(k, 0) + v
        for k, v in s.get("reloads", {}).items():  # every engine reloads the same file
            out["reloads"][k] = max(out["reloads"].get(k, 0), v)
        out["series"] = out.get("series", 0) + s.get("series", 0)
        for label, row in s.get("labels", {}).items():
            mine = out["labels"].get(label)
            if mine is None:
                out["labels"][label] = row
                continue
            for k in (
                "tokens",
                "borrowed",
                "shadow_over",
                "live",
                "held",
                "throttled_ns",
                "prompt",
                "prompt_over",
                "prompt_waiting",
                "prompt_waits",
                "prompt_borrowed",
            ):
                mine[k] = mine.get(k, 0) + row.get(k, 0)
            for k in ("wait", "interval"):
                mine[k] = add_json(mine[k], row[k])
        if out.get("store") is not None and s.get("store") is not None:
            merge_store(out["store"], s["store"])
        if s.get("quota") is not None:
            merge_quota(out.setdefault("quota", {}), s["quota"])
        if s.get("trace") is not None:  # each rank writes its own trace
            trace = out.setdefault("trace", {"dropped": 0})
            trace["dropped"] += s["trace"]["dropped"]
    return out


def families(data: dict[str, Any] | None) -> Iterator[Any]:
    """Prometheus metric families of one snapshot (names are a contract:
    README "Metrics")."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    if data is None:
        return
    labels: dict[str, dict[str, Any]] = data.get("labels", {})
    tokens = CounterMetricFamily(
        "outrate_output_tokens",
        "Output tokens charged to the limit, net of refunds.",
        labels=["limit"],
    )
    borrowed = CounterMetricFamily(
        "outrate_borrowed_tokens",
        "Output tokens borrowed from spare capacity (over the rate, within the peak), "
        "net of refunds; counted in outrate_output_tokens_total too.",
        labels=["limit"],
    )
    over = CounterMetricFamily(
        "outrate_shadow_over_limit_tokens",
        "Tokens a shadow limit would have refused (counted, not enforced).",
        labels=["limit"],
    )
    held = GaugeMetricFamily(
        "outrate_held_requests", "Requests held for budget right now.", labels=["limit"]
    )
    live = GaugeMetricFamily(
        "outrate_live_requests",
        "Requests in the engine under this limit (running, held or waiting).",
        labels=["limit"],
    )
    throttled = CounterMetricFamily(
        "outrate_throttled_seconds", "Request-seconds spent held for budget.", labels=["limit"]
    )
    rate = GaugeMetricFamily(
        "outrate_limit_tokens_per_second",
        "The configured rate of the limit (+Inf: unlimited).",
        labels=["limit", "mode"],
    )
    peak = GaugeMetricFamily(
        "outrate_limit_peak_tokens_per_second",
        "The peak of the limit: its rate plus what it may borrow from spare capacity "
        "(equal to the rate: no peak; +Inf: unlimited).",
        labels=["limit", "mode"],
    )
    prompt = CounterMetricFamily(
        "outrate_prompt_tokens",
        "Prompt tokens computed and charged to the limit, net of refunds (prefix-cache "
        "hits and recomputation free; counted while some rule limits prompts).",
        labels=["limit"],
    )
    prompt_rate = GaugeMetricFamily(
        "outrate_limit_prompt_tokens_per_second",
        "The configured prompt rate of the limit (+Inf: prompts unlimited).",
        labels=["limit", "mode"],
    )
    prompt_peak = GaugeMetricFamily(
        "outrate_limit_prompt_peak_tokens_per_second",
        "The prompt peak of the limit: its prompt rate plus what it may borrow in "
        "spare step time (equal to the prompt rate: no peak; +Inf: unlimited).",
        labels=["limit", "mode"],
    )
    prompt_borrowed = CounterMetricFamily(
        "outrate_prompt_borrowed_tokens",
        "Prompt tokens borrowed in spare step time (over the prompt rate, within its "
        "peak), net of refunds; counted in outrate_prompt_tokens_total too.",
        labels=["limit"],
    )
    prompt_over = CounterMetricFamily(
        "outrate_prompt_shadow_over_tokens",
        "Prompt tokens a shadow prompt limit would have held back (counted, not "
        "enforced); counted in outrate_prompt_tokens_total too.",
        labels=["limit"],
    )
    prompt_waiting = GaugeMetricFamily(
        "outrate_prompt_waiting_requests",
        "Requests waiting for prompt budget right now (a running prefill skipped, "
        "a waiting request deferred).",
        labels=["limit"],
    )
    prompt_waits = CounterMetricFamily(
        "outrate_prompt_waits",
        "Waits for prompt budget started (counted when the wait starts).",
        labels=["limit"],
    )
    wait = HistogramMetricFamily(
        "outrate_budget_wait_seconds",
        "How long a request was held for budget, per hold.",
        labels=["limit"],
    )
    interval = HistogramMetricFamily(
        "outrate_token_interval_seconds",
        "Engine-side time between consecutive charged tokens of one request.",
        labels=["limit"],
    )
    for label, v in sorted(labels.items()):
        tokens.add_metric([label], v["tokens"])
        borrowed.add_metric([label], v.get("borrowed", 0))
        over.add_metric([label], v["shadow_over"])
        held.add_metric([label], v["held"])
        live.add_metric([label], v["live"])
        throttled.add_metric([label], v["throttled_ns"] / NS_PER_S)
        if v.get("rate") is not None:
            r = float("inf") if v["rate"] < 0 else v["rate"]
            rate.add_metric([label, v["mode"]], r)
        if v.get("peak") is not None:
            p = float("inf") if v["peak"] < 0 else v["peak"]
            peak.add_metric([label, v["mode"]], p)
        prompt.add_metric([label], v.get("prompt", 0))
        if v.get("prompt_rate") is not None:
            r = float("inf") if v["prompt_rate"] < 0 else v["prompt_rate"]
            prompt_rate.add_metric([label, v["mode"]], r)
        if v.get("prompt_peak") is not None:
            p = float("inf") if v["prompt_peak"] < 0 else v["prompt_peak"]
            prompt_peak.add_metric([label, v["mode"]], p)
        prompt_borrowed.add_metric([label], v.get("prompt_borrowed", 0))
        prompt_over.add_metric([label], v.get("prompt_over", 0))
        prompt_waiting.add_metric([label], v.get("prompt_waiting", 0))
        prompt_waits.add_metric([label], v.get("prompt_waits", 0))
        for fam, (counts, sum_ns) in ((wait, v["wait"]), (interval, v["interval"])):
            fam.add_metric([label], cumulative(counts, BUCKETS_S), sum_ns / NS_PER_S)
    yield from (tokens, borrowed, over, held, live, throttled, rate, peak, prompt, prompt_rate)
    yield from (prompt_over, prompt_waiting, prompt_waits, prompt_peak, prompt_borrowed)
    yield from (wait, interval)
    for name, doc in (
        ("displaced", "Held requests preempted so a user with budget could run."),
        ("lent", "Held requests released to borrow spare capacity (over the rate, to the peak)."),
        (
            "reclaimed",
            "Borrowing requests held again because a committed request needed the slot "
            "or the token budget.",
        ),
    ):
        engine_wide = CounterMetricFamily(f"outrate_{name}", doc)
        engine_wide.add_metric([], data.get(name, 0))
        yield engine_wide
    deferred = CounterMetricFamily(
        "outrate_deferred",
        "Requests whose admission was deferred (counted when the deferral starts).",
        labels=["reason"],
    )
    for reason in DEFERRED_REASONS:
        deferred.add_metric([reason], data.get("deferred", {}).get(reason, 0))
    yield deferred
    reloads = CounterMetricFamily(
        "outrate_policy_reloads", "Policy file reloads by result.", labels=["result"]
    )
    for result in ("applied", "rejected"):
        reloads.add_metric([result], data.get("reloads", {}).get(result, 0))
    yield reloads
    info = GaugeMetricFamily(
        "outrate_policy_info", "The policy in force (value 1).", labels=["sha256", "source"]
    )
    policy = data.get("policy", {})
    info.add_metric([policy.get("sha256", ""), policy.get("source", "")], 1)
    yield info
    vllm = data.get("vllm")
    if vllm is not None:
        runs_on = GaugeMetricFamily(
            "outrate_vllm_info",
            'The vLLM the engine runs on (value 1); tested="false": newer than the '
            "releases outrate is tested on, run by opt-in (OUTRATE_UNTESTED_VLLM).",
            labels=["version", "tested"],
        )
        tested = "true" if vllm.get("tested") else "false"
        runs_on.add_metric([str(vllm.get("version", "")), tested], 1)
        yield runs_on
    trace = data.get("trace")
    if trace is not None:
        dropped = CounterMetricFamily(
            "outrate_trace_dropped_steps",
            "Trace lines (steps) dropped because the trace writer fell behind.",
        )
        dropped.add_metric([], trace["dropped"])
        yield dropped
    quota = data.get("quota")
    if quota is not None:
        yield from quota_families(quota)
    store = data.get("store")
    if store is not None:
        yield from store_families(store)


def quota_families(rows: dict[str, Any]) -> Iterator[Any]:
    """Quota usage per limit label, kind and window (outrate.observe.quotas)."""
    from prometheus_client.core import GaugeMetricFamily

    names = ["limit", "kind", "window"]
    used = GaugeMetricFamily(
        "outrate_quota_used_tokens",
        "Tokens counted in the current UTC quota window (an overrun included): the "
        "user's, or under a rule's label the sum over its users.",
        labels=names,
    )
    quota = GaugeMetricFamily(
        "outrate_quota_tokens",
        "The quota in force: tokens per window for one user of the limit.",
        labels=names,
    )
    spent = GaugeMetricFamily(
        "outrate_quota_spent_users",
        "Users of the limit whose quota of this kind and window is spent (refused with "
        "429 insufficient_quota until the window resets).",
        labels=names,
    )
    for label, keys in sorted(rows.items()):
        for key, row in sorted(keys.items()):
            kind, _, window = key.partition("/")
            used.add_metric([label, kind, window], row["used"])
            spent.add_metric([label, kind, window], row["spent"])
            if row.get("quota") is not None:
                quota.add_metric([label, kind, window], row["quota"])
    yield from (used, quota, spent)


class SnapshotCollector:
    """A prometheus_client collector reading the engine's newest snapshot."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        return families(read_snapshot(self.directory))

    def describe(self) -> list[Any]:
        return []  # unchecked collector: names are known only at collect time
