"""The budget store as one engine sees it (`--outrate-store`): counted by the
lease thread (outrate.budget.shared.runner), carried in the engine's metrics snapshot
under "store" (outrate.observe.publish.snapshot), merged across data-parallel ranks
and rendered beside the scheduler's families on /metrics.

Names are a contract (README "Metrics"): `outrate_store_up`,
`outrate_store_errors_total`, `outrate_store_transitions_total{to}`,
`outrate_lease_seconds`, `outrate_lease_calls_total`, `outrate_store_engines`,
`outrate_store_policy_mismatch`.
"""

from __future__ import annotations

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
        }


def merge_store(store: dict[str, Any], other: dict[str, Any]) -> None:
    """Fold another engine's store snapshot into `store`: the store is up only
    if every engine sees it; counts add up; engine counts are the widest view."""
    store["up"] = min(store["up"], other["up"])
    for k in ("errors", "round_trips", "calls"):
        store[k] += other[k]
    for k in ("engines", "policy_mismatch"):
        store[k] = max(store[k], other[k])
    for k, v in other["transitions"].items():
        store["transitions"][k] = store["transitions"].get(k, 0) + v
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
    yield from (up, errors, transitions, lease, calls, engines, mismatch)
