"""The budget store as one engine sees it (`--outrate-store`): counted by the
lease thread (outrate.budget.shared.runner), carried in the engine's metrics snapshot
under "store" (outrate.observe.publish.snapshot), merged across data-parallel ranks
and rendered beside the scheduler's families on /metrics.

Names are a contract (README "Metrics"): `outrate_store_up`,
`outrate_store_errors_total`, `outrate_store_transitions_total{to}`,
`outrate_lease_seconds`, `outrate_lease_calls_total`, `outrate_store_engines`,
`outrate_store_policy_mismatch`, `outrate_store_hold_mismatch`; and for the store's own faults
(docs/several-engines.md, "Faults"): `outrate_store_waiting`,
`outrate_store_engines_missing`, `outrate_store_primary{node}`,
`outrate_store_failovers_total`, `outrate_store_redirects_total{kind}`,
`outrate_store_resets_total`, `outrate_store_fallback_seconds`,
`outrate_store_hold_seconds`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from outrate.budget.limiter import NS_PER_S
from outrate.histogram import Histogram, add_json, cumulative

LEASE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
"""Upper bounds of `outrate_lease_seconds` (a round trip to the budget store)."""
LEASE_BUCKETS_NS = tuple(round(b * NS_PER_S) for b in LEASE_BUCKETS_S)


class StoreMetrics:
    """Written by the lease thread only; read by the metrics publisher."""

    def __init__(self) -> None:
        self.up = 0
        """1 while the store answers and budgets are shared; 0 in fallback."""
        self.errors = 0
        """Failed round trips (connection errors, timeouts, script errors)."""
        self.transitions = {"down": 0, "up": 0}
        self.lease = Histogram(LEASE_BUCKETS_NS)
        """Duration of each lease round trip (all users, one pipeline)."""
        self.round_trips = 0
        self.calls = 0
        """Lease calls (one per user and round that needed credit)."""
        self.engines = 0
        """Live engines by the last heartbeat (this one included)."""
        self.policy_mismatch = 0
        """Live engines whose policy sha256 differs from this engine's."""
        self.hold_mismatch = 0
        """Live engines whose hold (`--outrate-store-hold-s`) differs from this engine's."""
        self.waiting = 0
        """1 while limited users wait for the store (fallback `pause`): it was
        never reached, or the hold ran out (outrate.budget.shared.peers.HOLD_S)."""
        self.fallback_since = 0
        """Since when (monotonic ns) this engine has served limited users on its
        local fallback (rate/N, or the full rate); 0 while shared or waiting."""
        self.hold_s = 0.0
        """This engine's hold (`--outrate-store-hold-s`)."""
        self.engines_missing = 0
        """Engines whose heartbeat stopped without leaving, whose part is kept for them."""
        self.primaries: list[str] = []
        """host:port of each primary serving this engine's keys now."""
        self.failovers = 0
        """Primaries seen replaced by another node (Sentinel, or a cluster's replica)."""
        self.redirects = {"moved": 0, "ask": 0, "tryagain": 0}
        """Cluster redirects followed (a slot moved or moving, a replica promoted)."""
        self.resets = 0
        """Groups of users whose state was found lost under this engine (their epoch changed)."""

    def fallback_s(self, now_ns: int | None = None) -> float:
        """How long this engine has been on its local fallback (0: it is not)."""
        since = self.fallback_since
        if not since:
            return 0.0
        now = time.monotonic_ns() if now_ns is None else now_ns
        return max(0, now - since) / NS_PER_S

    def snapshot(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "errors": self.errors,
            "transitions": dict(self.transitions),
            "lease": self.lease.to_json(),
            "round_trips": self.round_trips,
            "calls": self.calls,
            "engines": self.engines,
            "policy_mismatch": self.policy_mismatch,
            "hold_mismatch": self.hold_mismatch,
            "waiting": self.waiting,
            "fallback_s": self.fallback_s(),
            "hold_s": self.hold_s,
            "engines_missing": self.engines_missing,
            "primaries": list(self.primaries),
            "failovers": self.failovers,
            "redirects": dict(self.redirects),
            "resets": self.resets,
        }


def merge_store(store: dict[str, Any], other: dict[str, Any]) -> None:
    """Fold another engine's store snapshot into `store`: the store is up only
    if every engine sees it; counts add up; engine counts are the widest view."""
    store["up"] = min(store["up"], other["up"])
    for k in ("errors", "round_trips", "calls", "failovers", "resets"):
        store[k] = store.get(k, 0) + other.get(k, 0)
    for k in (
        "engines",
        "policy_mismatch",
        "hold_mismatch",
        "waiting",
        "engines_missing",
        "fallback_s",
        "hold_s",
    ):
        store[k] = max(store.get(k, 0), other.get(k, 0))
    for name in ("transitions", "redirects"):
        mine = store.setdefault(name, {})
        for k, v in other.get(name, {}).items():
            mine[k] = mine.get(k, 0) + v
    store["primaries"] = sorted({*store.get("primaries", ()), *other.get("primaries", ())})
    store["lease"] = add_json(store["lease"], other["lease"])


def store_families(store: dict[str, Any]) -> Iterator[Any]:
    """Prometheus metric families of a store snapshot."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    up = GaugeMetricFamily(
        "outrate_store_up", "1 while the budget store answers and budgets are shared."
    )
    up.add_metric([], store["up"])
    errors = CounterMetricFamily("outrate_store_errors", "Failed round trips to the budget store.")
    errors.add_metric([], store["errors"])
    transitions = CounterMetricFamily(
        "outrate_store_transitions",
        "Switches to the local fallback (down) and back to shared budgets (up).",
        labels=["to"],
    )
    for to in ("down", "up"):
        transitions.add_metric([to], store["transitions"].get(to, 0))
    lease = HistogramMetricFamily(
        "outrate_lease_seconds", "Duration of one lease round trip (every user, one pipeline)."
    )
    counts, sum_ns = store["lease"]
    lease.add_metric([], cumulative(counts, LEASE_BUCKETS_S), sum_ns / NS_PER_S)
    calls = CounterMetricFamily(
        "outrate_lease_calls", "Per-user lease calls sent to the budget store."
    )
    calls.add_metric([], store["calls"])
    engines = GaugeMetricFamily(
        "outrate_store_engines", "Live engines sharing the store, by the last heartbeat."
    )
    engines.add_metric([], store["engines"])
    mismatch = GaugeMetricFamily(
        "outrate_store_policy_mismatch",
        "Live engines whose policy sha256 differs from this engine's.",
    )
    mismatch.add_metric([], store["policy_mismatch"])
    hold_mismatch = GaugeMetricFamily(
        "outrate_store_hold_mismatch",
        "Live engines whose --outrate-store-hold-s differs from this engine's.",
    )
    hold_mismatch.add_metric([], store.get("hold_mismatch", 0))
    fallback = GaugeMetricFamily(
        "outrate_store_fallback_seconds",
        "How long this engine has served limited users on its local fallback without the "
        "budget store (rate/N, or the full rate); 0 while budgets are shared.",
    )
    fallback.add_metric([], store.get("fallback_s", 0))
    hold = GaugeMetricFamily(
        "outrate_store_hold_seconds",
        "--outrate-store-hold-s: how long the other engines keep a missing engine's part.",
    )
    hold.add_metric([], store.get("hold_s", 0))
    waiting = GaugeMetricFamily(
        "outrate_store_waiting",
        "1 while limited users wait for the budget store (never reached, or the fallback ran out).",
    )
    waiting.add_metric([], store.get("waiting", 0))
    missing = GaugeMetricFamily(
        "outrate_store_engines_missing",
        "Engines whose heartbeat stopped without leaving; their part of each rate is kept.",
    )
    missing.add_metric([], store.get("engines_missing", 0))
    primary = GaugeMetricFamily(
        "outrate_store_primary",
        "1 for each store node serving this engine's keys as primary now.",
        labels=["node"],
    )
    for node in store.get("primaries", ()):
        primary.add_metric([node], 1)
    failovers = CounterMetricFamily(
        "outrate_store_failovers", "Store primaries seen replaced by another node."
    )
    failovers.add_metric([], store.get("failovers", 0))
    redirects = CounterMetricFamily(
        "outrate_store_redirects",
        "Redis Cluster redirects followed (MOVED: a slot moved; ASK: a slot moving; "
        "TRYAGAIN: a call retried at the next round while its slot moves).",
        labels=["kind"],
    )
    for kind in ("moved", "ask", "tryagain"):
        redirects.add_metric([kind], store.get("redirects", {}).get(kind, 0))
    resets = CounterMetricFamily(
        "outrate_store_resets",
        "Groups of users whose state was found lost in the store (FLUSHALL, a restart).",
    )
    resets.add_metric([], store.get("resets", 0))
    yield from (up, errors, transitions, lease, calls, engines, mismatch)
    yield from (waiting, missing, primary, failovers, redirects, resets)
    yield from (hold_mismatch, fallback, hold)
