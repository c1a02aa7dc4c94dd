"""The shared budget's metrics: the store's families on /metrics, and the
snapshots of data-parallel engines merged."""

from __future__ import annotations

import pytest
from shared_support import MS, policy


def test_store_metrics_reach_prometheus_families():
    from outrate.budget.shared.metrics import StoreMetrics
    from outrate.observe.metrics import Metrics
    from outrate.observe.publish import families, snapshot

    store = StoreMetrics()
    store.up, store.errors, store.engines = 1, 3, 2
    store.transitions["down"] = 1
    store.lease.observe(700_000)  # 0.7 ms
    fams = {f.name: f for f in families(snapshot(Metrics(), policy(), store=store.snapshot()))}
    for name in (
        "outrate_store_up",
        "outrate_store_errors",
        "outrate_store_transitions",
        "outrate_lease_seconds",
        "outrate_store_engines",
        "outrate_store_policy_mismatch",
    ):
        assert name in fams
    assert fams["outrate_store_errors"].samples[0].value == 3
    lease = {s.labels.get("le"): s.value for s in fams["outrate_lease_seconds"].samples}
    assert lease["0.0005"] == 0 and lease["0.001"] == 1
    assert "outrate_store_up" not in {f.name for f in families(snapshot(Metrics(), policy()))}


def test_data_parallel_engines_write_their_own_files_and_metrics_merge(tmp_path):
    """With --data-parallel-size N each engine core writes its own trace and
    metrics snapshot (`.dp<rank>`); /metrics shows their sum."""
    from outrate.budget.shared.metrics import StoreMetrics
    from outrate.observe.metrics import Metrics
    from outrate.observe.publish import read_snapshot, snapshot, write_snapshot

    pol = policy()
    snaps = []
    for rank in range(2):
        m, store = Metrics(), StoreMetrics()
        store.up, store.engines, store.errors = rank, 2, 1  # rank 0 sees no store
        m.record("alice").tokens = 10 + rank
        m.record("alice").interval.observe(5 * MS)
        snaps.append(snapshot(m, pol, store=store.snapshot()))
        write_snapshot(str(tmp_path / f"engine-metrics.dp{rank}.json"), snaps[-1])
    merged = read_snapshot(str(tmp_path))
    assert merged is not None
    assert merged["labels"]["alice"]["tokens"] == 21
    assert sum(merged["labels"]["alice"]["interval"][0]) == 2
    assert merged["store"]["up"] == 0 and merged["store"]["errors"] == 2
    assert merged["store"]["engines"] == 2
    pytest.importorskip("vllm")
    from vllm_integration.common.settings import EngineSettings, dp_suffix, rank_path

    class PC:
        data_parallel_size = 2
        data_parallel_index = 1

    class VC:
        parallel_config = PC()

    assert dp_suffix(VC()) == ".dp1" and dp_suffix(None) == ""
    PC.data_parallel_size = 1  # what vLLM leaves in a non-MoE data-parallel engine core
    assert dp_suffix(VC()) == ""
    assert dp_suffix(VC(), EngineSettings(data_parallel_size=2)) == ".dp1"
    assert rank_path("/x/trace.jsonl", ".dp1") == "/x/trace.dp1.jsonl"
