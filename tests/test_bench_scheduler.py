"""The scheduler benchmark runs and its numbers are sane (timing targets are
not asserted here: this machine is too noisy for that)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_scheduler as bench  # noqa: E402

pytestmark = pytest.mark.vllm

TINY = bench.Sizes(warmup=12, rounds=3, steps=3)


def test_measure_tiny() -> None:
    """One smoke run of a throttled cell: the table's row and its figures."""
    mode, throttled, scheduled = "async", 0.5, 8
    res = bench.measure(bench.Cell(mode, 16, 4, throttled), TINY, copies=2)
    assert res.scheduled == scheduled
    assert res.stock_all_us > 0 and res.stock_sched_us > 0 and res.outrate_us > 0
    assert res.ratio > 0 and res.aa > 0
    assert res.users_label == "2+2"
    assert res.target is None
    row = bench.format_table([res]).splitlines()[-1].split()
    assert row[:5] == [mode, "16", res.users_label, f"{throttled * 100:.0f}", str(scheduled)]


def test_measure_tiny_borrowers() -> None:
    """A borrower cell (half the requests borrowing, with committed users
    beside them): every request scheduled, its own table, no target."""
    cell = bench.Cell("sync", 16, 4, 0.0, borrowing=0.5)
    assert cell.name == "sync:16:4:b50"
    res = bench.measure(cell, TINY, copies=1)
    assert res.scheduled == 16
    assert res.users_label == "2+2"
    assert res.ratio > 0 and res.aa > 0 and res.outrate_us > 0
    assert res.target is None and res.passed is None
    table = bench.format_table([res]).splitlines()
    assert table[0].startswith("Borrowers:")
    assert table[-1].split()[:6] == ["sync", "16", "2+2", "50", "unlimited", "16"]


def test_borrowers_borrow_every_token() -> None:
    """Past warm-up a borrower cell's users are past their committed rate:
    every request of theirs is borrowing, and each step's tokens are
    borrowed; with a finite peak too."""
    w = bench.workload(16, 4, 0.0, borrowing=1.0)
    for peak in ("unlimited", bench.FREE_RATE):
        b = bench.build("async", w.users, TINY, bench.policy_for(w, peak))
        labels = {id(u.m): u.m for u in b.sched._users.values()}.values()
        borrowed = sum(m.borrowed for m in labels)
        b.run(3)
        assert len(b.sched.lending) == 16 and b.median_scheduled() == 16, peak
        assert sum(m.borrowed for m in labels) - borrowed == 3 * 16, peak


def test_workload_spreads_throttled_requests() -> None:
    w = bench.workload(1024, 16, 0.95)
    assert w.label == "15+1"
    assert w.n_throttled == round(0.95 * 1024)
    assert w.users[:4].count("u0") <= 1  # spread through arrival order, not bunched
    one = bench.workload(64, 1, 0.5)
    assert one.label == "1+1" and one.n_throttled == 32
    assert set(bench.workload(64, 16, 0.0).users) == {f"u{i}" for i in range(16)}
    lenders = bench.workload(64, 16, 0.0, borrowing=1.0)
    assert lenders.label == "16" and lenders.n_borrowing == 64 and not lenders.free_users
    mixed = bench.workload(64, 16, 0.0, borrowing=0.5)
    assert mixed.label == "8+8" and mixed.n_borrowing == 32 and mixed.n_throttled == 0
    with pytest.raises(ValueError, match="not both"):
        bench.workload(64, 16, 0.5, borrowing=0.5)


def test_grid_covers_the_brief() -> None:
    full = bench.grid(quick=False)
    assert {c.running for c in full} == {64, 256, 1024}
    assert {c.users for c in full} == {1, 16, 256}
    assert {c.throttled for c in full} == {0.0, 0.5, 0.95}
    assert {c.mode for c in full} == {"sync", "async"}
    assert all(c.users <= c.running for c in full)
    assert len(bench.grid(quick=True)) < len(full)
    for quick in (False, True):  # borrowers: R = 64 and 256, sync and async, in both grids
        cells = bench.grid(quick)
        lending = {c.name for c in cells if c.borrowing}
        assert len(lending) == 12
        assert {"sync:64:16:b100", "async:256:16:b50", "async:256:16:b100@1000000"} <= lending
        assert len({c.name for c in cells}) == len(cells)  # --only tells every cell apart


def test_isolated_times_both_hooks() -> None:
    step_us, ours, stock, diff = bench.isolated(bench.Cell("sync", 16, 4, 0.0), TINY, reps=6)
    assert step_us > 0 and ours > 0 and stock > 0
    assert abs(diff) < ours + stock


def test_copies_see_the_same_requests() -> None:
    """Copies differ only in where their objects land: same ids, same prompts,
    each prompt distinct within a scheduler."""
    a = bench.build("stock-sync", [None] * 8, TINY, None)
    b = bench.build("stock-sync", [None] * 8, TINY, None)
    assert list(a.sched.requests) == list(b.sched.requests) == [f"q{i}" for i in range(8)]
    for rid in a.sched.requests:
        assert a.sched.requests[rid].prompt_token_ids == b.sched.requests[rid].prompt_token_ids
    assert len({tuple(bench.prompt(i)) for i in range(1024)}) == 1024


def test_check_flags_a_missed_target() -> None:
    cell = bench.Cell("sync", 1024, 16, 0.95)
    ok = bench.Result(cell, "15+1", 51, 9000.0, 400.0, 480.0, ratio=1.2)
    bad = bench.Result(cell, "15+1", 51, 9000.0, 400.0, 600.0, ratio=1.5)
    assert ok.passed is True and bad.passed is False
    assert "FAIL" in bench.format_table([ok, bad]).splitlines()[-1]
    lending = bench.Result(bench.Cell("sync", 64, 16, 0.0, 1.0), "16", 64, 900.0, 900.0, 2e3, 2.2)
    assert lending.passed is None  # no target: --check does not fail on borrower cells


def test_ablations_change_what_they_name() -> None:
    """Each variant of `--ablate` removes or heats the part it names, and
    nothing else is left broken: every variant still schedules every request."""
    w = bench.workload(8, 4, 0.0)
    built = {}
    for name in bench.ABLATIONS:
        b = bench.build("sync", w.users, TINY, bench.policy_for(w))
        bench._ablated(b.sched, name)
        before = {u.key: u.bucket.tat for u in b.sched._users.values()}
        tokens = {u.key: u.m.tokens for u in b.sched._users.values()}
        charged = b.sched.charged
        b.run(3)
        assert b.median_scheduled() == 8, name
        built[name] = (b.sched, before, tokens, charged)
    users = lambda name: list(built[name][0]._users.values())  # noqa: E731
    assert len({id(u.bucket) for u in users("hot-bucket")}) == 1
    assert len({id(u.m) for u in users("hot-label")}) == 1
    _, before, _, _ = built["no-store"]
    assert all(u.bucket.tat == before[u.key] for u in users("no-store"))  # never charged
    _, before, _, _ = built["shipped"]
    assert all(u.bucket.tat != before[u.key] for u in users("shipped"))
    counted = lambda u: u.m.tokens  # noqa: E731
    _, _, tokens, _ = built["shipped"]
    assert all(counted(u) > tokens[u.key] for u in users("shipped"))
    _, _, tokens, _ = built["no-metrics"]
    assert all(counted(u) == tokens[u.key] for u in users("no-metrics"))  # nothing counted
    sched, before, tokens, charged = built["bare"]  # stock's hook, no end of step
    assert sched.charged == charged
    assert all(counted(u) == tokens[u.key] for u in users("bare"))
    assert all(u.bucket.tat == before[u.key] for u in users("bare"))
    with pytest.raises(ValueError, match="unknown ablation"):
        bench._ablated(sched, "nope")


def test_ablate_measures_every_variant() -> None:
    res = bench.ablate(bench.Cell("sync", 8, 4, 0.0), TINY, copies=1)
    assert list(res) == ["a/a", *bench.ABLATIONS]
    assert all(v > 0 for v in res.values())
