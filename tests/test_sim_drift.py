"""The simulate tests' machine probe (tests/sim_drift.py) on fabricated
traces: it compares decode-only steps of one batch size, asks no model, and
a case it cannot judge fails under CI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from sim_drift import bracket, last, machine_drift, model_error, told, unjudgeable

from outrate.simulate.tracefit import decode_step_us
from outrate.simulate.workload import load_workload

WORKLOAD = load_workload(
    Path(__file__).resolve().parent.parent / "examples" / "workloads" / "e2e-agree.yaml"
).workload


def trace(lengths_us: list[tuple[int, int]]) -> list:
    """Step lines: each (requests decoding, step length in us). A step whose
    batch grew admitted a request (its prompt computed there), as the first
    step did."""
    lines, t = [], 0
    for step, (decoding, us) in enumerate(lengths_us):
        lines.append({"step": step, "t": t, "charged": {"alice": decoding}})
        t += us * 1000
    lines.append({"step": len(lengths_us), "t": t, "charged": {"alice": 1}})
    return lines


def test_decode_steps_are_grouped_by_batch_size_and_prefill_steps_left_out():
    steps = decode_step_us(trace([(3, 7000)] * 6 + [(4, 8000)] * 6), WORKLOAD)
    assert steps == {3: [7000.0] * 5, 4: [8000.0] * 5}  # steps 0 and 6 computed a prompt


def test_the_machine_drift_is_the_decode_steps_ratio_whatever_the_mix():
    reference = decode_step_us(trace([(3, 7000)] * 10 + [(4, 8000)] * 10), WORKLOAD)
    slower = decode_step_us(trace([(3, 7700)] * 20 + [(4, 8800)] * 5), WORKLOAD)
    assert machine_drift(reference, slower) == pytest.approx(0.10)
    same = decode_step_us(trace([(4, 8000)] * 30 + [(3, 7000)] * 5), WORKLOAD)
    assert machine_drift(reference, same) == pytest.approx(0.0)


def test_no_shared_batch_size_cannot_be_told():
    reference = decode_step_us(trace([(3, 7000)] * 10), WORKLOAD)
    other = decode_step_us(trace([(6, 9000)] * 10), WORKLOAD)
    few = decode_step_us(trace([(3, 7000)] * 3), WORKLOAD)
    assert math.isnan(machine_drift(reference, other))
    assert math.isnan(machine_drift(reference, few))
    assert not told(math.nan)  # the only case left unjudged: fails under CI
    assert told(machine_drift(reference, reference))


def test_a_case_that_cannot_be_judged_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="cannot be judged under CI: moved"):
        unjudgeable("moved")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="moved"):
        unjudgeable("moved")


def test_the_models_own_error_is_its_error_with_the_machines_move_taken_out():
    # Steps 20% longer on a machine that slowed by 20%: the model is right.
    assert model_error(1 / 1.2 - 1, 0.2) == pytest.approx(0.0)
    # The machine did not move: the model's error is all its own.
    assert model_error(-0.25, 0.0) == pytest.approx(-0.25)


def test_the_machine_over_a_run_is_the_mean_of_the_probes_around_it():
    assert bracket(0.0, 0.2) == pytest.approx(0.1)
    assert bracket(math.nan, 0.2) == pytest.approx(0.2)  # the one that could tell
    assert bracket(-0.1, math.nan) == pytest.approx(-0.1)
    assert not told(bracket(math.nan, math.nan))


def test_a_plays_end_is_its_last_seconds():
    steps = trace([(3, 1_000_000)] * 10)  # a step a second
    assert [r["step"] for r in last(steps, seconds=3)] == [7, 8, 9, 10]
    assert last([], seconds=3) == []
