"""Two real vLLM schedulers sharing one budget through a real redis-server
(tests/store_engines.py: vLLM's own schedulers, KV cache managers and
requests, fabricated model outputs, real time). The bound is checked on what
the schedulers charged, merged over both engines."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

from store_engines import BURST_NS, Engine, longest_gap_ms  # noqa: E402

from outrate.budget.shared.credit import LEASE_INTERVAL_S  # noqa: E402
from outrate.observe.trace import engine_rate, max_window_excess  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_two_schedulers_share_one_budget(kind, redis_server):
    redis_server.client().flushall()
    engines = [Engine(kind, redis_server.url, f"{kind}-{i}").start() for i in range(2)]
    drivers = []
    for e in engines:
        e.add("alice", 2)
        e.add("free", 1)
        drivers.append(e.driver)
    # 6 s of real time, so a stall of a few hundred ms (a starved process on a
    # loaded 2-core CI machine) costs alice under 10% of her tokens; steps every
    # ~4 ms keep the unlimited requests under max_model_len (~2,000 tokens).
    until = time.monotonic() + 6.0
    while time.monotonic() < until:
        for d in drivers:
            d.step()
        time.sleep(0.004)
    for e in engines:
        e.runner.stop()
    per_engine = [e.rec.tokens("alice") for e in engines]
    merged = sorted(per_engine[0] + per_engine[1])
    counts = [sum(k for _, k in steps) for steps in per_engine]
    excess = max_window_excess(merged, 20, BURST_NS)
    slack = 20 * LEASE_INTERVAL_S + 2  # rate * H + N, H = 20 ms: a little under S (stricter)
    rate = engine_rate(merged)
    # A lease thread that starts its rounds late (a starved process) leaves
    # its engine without credit meanwhile: that time is discounted, at the
    # full rate (conservative: the other engine still paces at its share).
    late_s = max(e.runner.late_ns for e in engines) / 1e9
    span_s = (merged[-1][0] - merged[0][0]) / 1e9
    floor = 0.9 * 20 * max(0.0, span_s - late_s) / span_s
    free = [sum(k for _, k in e.rec.tokens("free")) for e in engines]
    steps = [d.steps for d in drivers]
    print(
        f"{kind}: alice {counts} tokens at {rate:.2f} tok/s, worst window {excess:+.2f} "
        f"(slack {slack:.1f}); free {free} tokens in {steps} steps; "
        f"lease rounds {[e.runner.metrics.round_trips for e in engines]}, "
        f"late {late_s * 1000:.0f} ms (floor {floor:.2f} tok/s), "
        f"longest gap between alice's tokens {longest_gap_ms(merged):.0f} ms"
    )
    assert excess <= slack
    assert rate >= floor
    assert min(counts) >= 0.35 * sum(counts)  # both engines make progress, fairly
    # The unlimited user ran one token per step throughout, on both engines.
    for f, n in zip(free, steps, strict=True):
        assert f >= n - 3
    for e, n in zip(engines, counts, strict=True):
        assert e.runner.metrics.errors == 0 and e.runner.metrics.up == 1
        assert e.sched.metrics.labels["alice"].tokens == n  # metrics agree with the charges
