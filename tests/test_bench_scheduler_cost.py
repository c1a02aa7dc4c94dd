"""bench_scheduler.py's cells of issue 40: prompt limits (p<N>) and lending by
step time (t<borrow%>). They run and mean what their names say (timing is
not asserted: this machine is too noisy for that)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_scheduler as bench  # noqa: E402

pytestmark = pytest.mark.vllm

TINY = bench.Sizes(warmup=12, rounds=3, steps=3)


def test_the_cells_are_named_and_listed() -> None:
    cells = {c.name: c for c in bench.cost_grid()}
    assert {
        "sync:64:16:0",
        "sync:64:16:p0",
        "async:256:16:p8",
        "async:256:16:pb8",
        "sync:64:16:t50",
    } <= set(cells)
    assert len(cells) == len(bench.cost_grid()) == 20
    assert cells["sync:64:16:pb8"].prompt_peak and not cells["sync:64:16:p8"].prompt_peak
    assert not {c.name for c in bench.grid(quick=True)} & {
        n for n, c in cells.items() if c.prompting is not None or c.timed
    }


def test_prompt_workload_gives_each_prompting_user_one_request() -> None:
    w = bench.prompt_workload(64, 16, 8)
    assert w.label == "8+8"
    assert [w.users.count(f"p{i}") for i in range(8)] == [1] * 8
    assert bench.prompt_lengths(w).count(bench.LONG_PROMPT) == 8
    assert w.users[:8].count("p0") == 1 and "p1" not in w.users[:7]  # spread, not bunched
    none = bench.prompt_workload(64, 16, 0)
    assert none.label == "0+16" and not none.prompting_users
    with pytest.raises(ValueError):
        bench.prompt_workload(64, 16, 16)


def test_paced_prompts_prefill_a_few_tokens_every_step() -> None:
    """p cells: every request scheduled every step, the prompting users'
    requests still prefilling, each chunk within its user's prompt pace."""
    w = bench.prompt_workload(16, 4, 2)
    pol = bench.policy_for(w, prompts=True)
    assert pol.prompt_rules
    b = bench.build("sync", w.users, TINY, pol, bench.prompt_lengths(w))
    before = {q.request_id: q.num_computed_tokens for q in b.sched.running}
    b.run(5)
    assert b.median_scheduled() == 16
    long = [q for q in b.sched.running if q.num_prompt_tokens == bench.LONG_PROMPT]
    assert len(long) == 2 and all(q.is_prefill_chunk for q in long)
    for q in long:  # 400 tok/s on 10 ms steps: ~4 tokens a step
        assert 0 < q.num_computed_tokens - before[q.request_id] <= 5 * 4 + 1
    stock = bench.build("stock-sync", [None] * 16, TINY, None, bench.prompt_lengths(w), chunk=4)
    before = {q.request_id: q.num_computed_tokens for q in stock.sched.running}
    stock.run(5)
    long = [q for q in stock.sched.running if q.num_prompt_tokens == bench.LONG_PROMPT]
    assert len(long) == 2 and all(q.is_prefill_chunk for q in long)  # the same work, in stock
    assert all(q.num_computed_tokens - before[q.request_id] == 5 * 4 for q in long)


def test_a_prompt_peak_cell_does_the_same_work_half_of_it_borrowed() -> None:
    """pb cells: the paced prompts of a p cell, committed at half the pace
    with a peak at the pace: the same chunks every step (so the same stock
    base), about half of their tokens borrowed."""
    w = bench.prompt_workload(16, 4, 2)
    pol = bench.policy_for(w, prompts=True, prompt_peak=True)
    assert all(pol.prompts.limit_for(u).excess is not None for u in w.prompting_users)
    b = bench.build("sync", w.users, TINY, pol, bench.prompt_lengths(w))
    b.run(5)  # warm-up: the 100 ms bursts spent, steady state from here
    long = [q for q in b.sched.running if q.num_prompt_tokens == bench.LONG_PROMPT]
    before = {q.request_id: q.num_computed_tokens for q in long}
    lent = bench.prompt_borrowed(b)
    counted = sum(m.prompt for m in b.sched.metrics.labels.values())
    b.run(20)
    assert b.median_scheduled() == 16
    assert len(long) == 2 and all(q.is_prefill_chunk for q in long)
    done = sum(q.num_computed_tokens - before[q.request_id] for q in long)
    assert 2 * 20 * 4 - 4 <= done <= 2 * 20 * 4 + 4  # 400 tok/s in all, as in p cells
    lent = bench.prompt_borrowed(b) - lent
    assert sum(m.prompt for m in b.sched.metrics.labels.values()) - counted == done
    assert 0.4 * done <= lent <= 0.6 * done, (lent, done)


def test_measure_tiny_prompt_and_timed_cells() -> None:
    for cell, scheduled in (
        (bench.Cell("sync", 16, 4, 0.0, prompting=2), 16),
        (bench.Cell("async", 16, 4, 0.0, prompting=2, prompt_peak=True), 16),
        (bench.Cell("async", 64, 16, 0.0, 0.5, timed=True), None),
    ):
        res = bench.measure(cell, TINY, copies=1)
        assert res.ratio > 0 and res.aa > 0 and res.outrate_us > 0
        assert res.target is None and res.passed is None
        row = bench.format_table([res]).splitlines()[-1].split()
        assert row[3] == cell.name.rsplit(":", 1)[1], row
        if scheduled is not None:
            assert res.scheduled == scheduled
        else:  # the time target holds some borrowers back
            assert 32 < res.scheduled < 64, res.scheduled


def test_lending_by_time_binds_on_the_costed_clock() -> None:
    """t50 at R = 64: committed users at 320 tok/s with 4 streams each allow
    0.8 x 4 / 320 = 10 ms a step; their 32 decodes take 8.2 ms on the clock,
    so ~18 of the 32 borrowers' requests fit (0.1 ms each)."""
    assert bench.committed_rate(64) == "327"
    w = bench.workload(64, 16, 0.0, borrowing=0.5)
    pol = bench.policy_for(w, committed=bench.committed_rate(64))
    b = bench.build("sync", w.users, TINY, pol, cost=bench.TIMED_STEP)
    b.run(10)
    lent = len(b.sched.lending)
    print(f"lending by time: {lent} of 32 borrowers' requests, {b.median_scheduled()} scheduled")
    assert 8 <= lent <= 24 and 32 < b.median_scheduled() <= 32 + 24
