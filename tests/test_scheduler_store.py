"""Two real vLLM schedulers sharing one budget through a real redis-server.

The schedulers, KV cache managers and requests are vLLM's own, the model
outputs fabricated (vllm_harness). Time is real here: the global GCRA runs
on the Redis server's TIME, so both schedulers use CLOCK_MONOTONIC (the same
clock on one machine) and are stepped every few milliseconds. The bound is
checked on what the schedulers charged, merged over both engines."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

from vllm_harness import Driver, make_request, make_scheduler  # noqa: E402

from outrate.budget.limiter import Limiter  # noqa: E402
from outrate.budget.shared.credit import LEASE_INTERVAL_S, SharedBudget  # noqa: E402
from outrate.budget.shared.lease import RedisLink  # noqa: E402
from outrate.budget.shared.runner import LeaseRunner  # noqa: E402
from outrate.observe.trace import engine_rate, max_window_excess  # noqa: E402
from outrate.policy.compiler import compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402

pytestmark = pytest.mark.vllm

BURST_NS = 100_000_000
POLICY = "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: 20\n"


class Recorder:
    """Stands in for the TraceWriter: keeps every step's charges."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def step(self, entry: tuple) -> None:
        self.steps.append(entry)

    def event(self, t: int, **fields: object) -> None:
        pass

    def tokens(self, user: str) -> list[tuple[int, int]]:
        out = []
        for t, _, charged, refunded, *_ in self.steps:
            n = charged.get(user, 0) - refunded.get(user, 0)
            if n:
                out.append((t, n))
        return out


def shared_scheduler(kind: str, url: str, name: str):
    pol = compile_policy(parse_policy(POLICY, "t.yaml"), "t.yaml", "sha-t")
    sched = make_scheduler(kind)
    budget = SharedBudget()
    limiter = Limiter(pol, lender=budget)
    sched.outrate_configure(pol, limiter=limiter)  # CLOCK_MONOTONIC
    runner = LeaseRunner(
        limiter, budget, RedisLink(url), policy_sha=lambda: pol.sha256, engine=name
    )
    runner.start()
    rec = Recorder()
    sched.outrate_trace(rec)
    return sched, runner, rec


def longest_gap_ms(steps: list[tuple[int, int]]) -> float:
    return max((b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False)), default=0) / 1e6


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_two_schedulers_share_one_budget(kind, redis_server):
    redis_server.client().flushall()
    engines = [shared_scheduler(kind, redis_server.url, f"{kind}-{i}") for i in range(2)]
    drivers = []
    for sched, _, _ in engines:
        d = Driver(sched)
        for _ in range(2):
            d.add(make_request("alice", max_tokens=100_000))
        d.add(make_request("free", max_tokens=100_000))
        drivers.append(d)
    # 6 s of real time, so a stall of a few hundred ms (a starved process on a
    # loaded 2-core CI machine) costs alice under 10% of her tokens; steps every
    # ~4 ms keep the unlimited requests under max_model_len (~2,000 tokens).
    until = time.monotonic() + 6.0
    while time.monotonic() < until:
        for d in drivers:
            d.step()
        time.sleep(0.004)
    for _, runner, _ in engines:
        runner.stop()
    per_engine = [rec.tokens("alice") for _, _, rec in engines]
    merged = sorted(per_engine[0] + per_engine[1])
    counts = [sum(k for _, k in steps) for steps in per_engine]
    excess = max_window_excess(merged, 20, BURST_NS)
    slack = 20 * LEASE_INTERVAL_S + 2  # rate * H + N, H = 20 ms: a little under S (stricter)
    rate = engine_rate(merged)
    # A lease thread that starts its rounds late (a starved process) leaves
    # its engine without credit meanwhile: that time is discounted, at the
    # full rate (conservative: the other engine still paces at its share).
    late_s = max(r.late_ns for _, r, _ in engines) / 1e9
    span_s = (merged[-1][0] - merged[0][0]) / 1e9
    floor = 0.9 * 20 * max(0.0, span_s - late_s) / span_s
    free = [sum(k for _, k in rec.tokens("free")) for _, _, rec in engines]
    steps = [d.steps for d in drivers]
    print(
        f"{kind}: alice {counts} tokens at {rate:.2f} tok/s, worst window {excess:+.2f} "
        f"(slack {slack:.1f}); free {free} tokens in {steps} steps; "
        f"lease rounds {[r.metrics.round_trips for _, r, _ in engines]}, "
        f"late {late_s * 1000:.0f} ms (floor {floor:.2f} tok/s), "
        f"longest gap between alice's tokens {longest_gap_ms(merged):.0f} ms"
    )
    assert excess <= slack
    assert rate >= floor
    assert min(counts) >= 0.35 * sum(counts)  # both engines make progress, fairly
    # The unlimited user ran one token per step throughout, on both engines.
    for f, n in zip(free, steps, strict=True):
        assert f >= n - 3
    for (sched, runner, _), n in zip(engines, counts, strict=True):
        assert runner.metrics.errors == 0 and runner.metrics.up == 1
        assert sched.metrics.labels["alice"].tokens == n  # metrics agree with the charges
