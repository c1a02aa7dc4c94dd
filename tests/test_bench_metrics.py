"""The metrics benchmark compares like with like: its variant without metrics
makes the same decisions as the shipped scheduler (timing targets are not
asserted here: this machine is too noisy for that)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_metrics  # noqa: E402
import bench_scheduler as bench  # noqa: E402

pytestmark = pytest.mark.vllm

TINY = bench.Sizes(warmup=12, rounds=3, steps=3)
STORE_VERBS = ("take_upto", "give_back", "ready_at", "available", "cleanup")


def _counted(sched: Any) -> Counter[str]:
    calls: Counter[str] = Counter()
    for verb in STORE_VERBS:
        real = getattr(sched.limiter, verb)

        def counted(*a: Any, _real: Any = real, _verb: str = verb, **kw: Any) -> Any:
            calls[_verb] += 1
            return _real(*a, **kw)

        setattr(sched.limiter, verb, counted)
    return calls


def test_without_metrics_decides_alike() -> None:
    """The variant without metrics makes the shipped scheduler's decisions
    (a throttled async cell: holds, resumes and store calls alike)."""
    mode, throttled = "async", 0.5
    w = bench.workload(16, 4, throttled)
    seen = {}
    for variant in ("shipped", "without"):
        b = bench.build(mode, w.users, TINY, bench.policy_for(w))
        s = b.sched
        if variant == "without":
            bench_metrics.without_metrics(s)
        calls = _counted(s)
        b.reset()
        b.run(20)
        tokens = s.charged  # every label's counter
        seen[variant] = (b.scheduled, len(s.holdback), dict(calls), s.metrics.holds, tokens)
    shipped, without = seen["shipped"], seen["without"]
    assert shipped[:4] == without[:4]  # same steps, holds and store calls
    assert shipped[2]["take_upto"] > 0
    assert (len(shipped[0]) and shipped[1]) if throttled else shipped[1] == 0
    assert shipped[4] > without[4]  # only the shipped one counted the 20 steps


def test_isolated_times_both() -> None:
    """One smoke run of `--isolated`'s measurement: both variants timed, and
    the shipped `Ledger.charge` back in place after it."""
    w = bench.workload(16, 4, 0.0)
    b = bench.build("sync", w.users, TINY, bench.policy_for(w))
    bench.interleave([b], TINY)
    before = b.sched.charged
    on, off, diff = bench_metrics.isolated(b, 6)
    assert on > 0 and off > 0 and abs(diff) < on + off
    assert b.sched.charged == before + 6 * 16  # the 6 shipped steps counted, the others not
    assert b.sched.ledger.charge.__name__ == "charge"
