"""`outrate_trace_dropped_steps_total`: the trace lines the writer dropped
because it fell behind (outrate.observe.trace), carried in the metrics snapshot and
rendered on /metrics (outrate.observe.metrics). The OutrateTraceDropping alert
(ops/prometheus/outrate-rules.yml) reads it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from outrate.observe.metrics import Metrics
from outrate.observe.publish import families, merge_snapshots, snapshot
from outrate.observe.trace import Step, TraceWriter, read_trace
from outrate.policy.compiler import compile_policy
from outrate.policy.loader import parse_policy


def policy():
    return compile_policy(parse_policy("version: 1\ndefault: 10\n", "t.yaml"), "t.yaml", "sha-a")


def step(t: int) -> Step:
    return (t, t, 1, {"alice": 1}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, 0, 0)


def test_the_writer_counts_every_line_it_dropped_since_start(tmp_path):
    # No writer thread: the queue of 3 overflows, as when the disk stalls.
    writer = TraceWriter(str(tmp_path / "trace.jsonl"), max_pending=3)
    for t in range(5):
        writer.step(step(t))
    assert writer.dropped_total == 0  # counted when the writer catches up
    writer.stop()
    assert writer.dropped_total == 2
    lines = read_trace(tmp_path / "trace.jsonl")
    assert [r["dropped"] for r in lines if "dropped" in r] == [2]
    assert [r["step"] for r in lines if "step" in r] == [2, 3, 4]


def test_the_total_keeps_growing_over_drains(tmp_path):
    writer = TraceWriter(str(tmp_path / "trace.jsonl"), max_pending=2)
    for t in range(4):
        writer.step(step(t))
    writer._drain()
    writer.event(10, policy="x")
    for t in range(5, 8):
        writer.step(step(t))
    writer.stop()
    assert writer.dropped_total == 2 + 2  # the trace's two `dropped` lines, added up
    assert sum(r.get("dropped", 0) for r in read_trace(tmp_path / "trace.jsonl")) == 4


def exposition(data) -> str:
    registry = CollectorRegistry()

    class Collector:
        def collect(self):
            return families(data)

    registry.register(Collector())
    return generate_latest(registry).decode()


def test_dropped_lines_reach_metrics_as_a_counter():
    text = exposition(snapshot(Metrics(), policy(), trace_dropped=7))
    assert "# TYPE outrate_trace_dropped_steps_total counter" in text
    assert "outrate_trace_dropped_steps_total 7.0" in text


def test_without_a_trace_there_is_no_series():
    assert "outrate_trace_dropped" not in exposition(snapshot(Metrics(), policy()))


def test_data_parallel_ranks_add_up():
    pol = policy()
    merged = merge_snapshots(
        [
            snapshot(Metrics(), pol, trace_dropped=3),
            snapshot(Metrics(), pol, trace_dropped=4),
            snapshot(Metrics(), pol),  # a rank without its trace (cannot happen today)
        ]
    )
    assert merged is not None and merged["trace"] == {"dropped": 7}
    merged = merge_snapshots([snapshot(Metrics(), pol), snapshot(Metrics(), pol, trace_dropped=5)])
    assert merged is not None and merged["trace"] == {"dropped": 5}
