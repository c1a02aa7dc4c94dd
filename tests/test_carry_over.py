"""benchmarks/carry_over.py (docs/simulate.md, "Out of sample"): on a
simulated trace laid out as test_simulate_oos's server writes one (warm-up,
calibration, e2e-idle, a case and its probe, back to back, the engine idle
between them), whose steps last what one linear model says, it finds each
play, and the model carries over; with the machine slowing steadily from
the case's start to 25% slower at the probe's end, the probes before and
after read the move and the model's own error stays what it was."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import carry_over  # noqa: E402

from outrate.observe.trace import read_trace  # noqa: E402
from outrate.simulate.engine import engine_from_flags  # noqa: E402
from outrate.simulate.stepmodel import StepModel  # noqa: E402
from outrate.simulate.workload import load_workload  # noqa: E402
from vllm_integration.offline.simulator import simulate  # noqa: E402

pytestmark = pytest.mark.vllm
WORKLOADS = REPO / "examples" / "workloads"
PLAYS = (("e2e-agree", 3), ("e2e-agree", 15), ("e2e-idle", 0), ("oos-hog", 0), ("e2e-agree", 5))


def _trace(tmp_path: Path, slower: float, case: str = "oos-hog") -> Path:
    """The plays simulated one after another into one trace, 2 s apart (the
    case: `case`); from the case's start the machine slows steadily, every
    step longer by a factor rising from 1 to `slower` at the probe's end
    (the time warped by its integral)."""
    model = StepModel(fixed_us=3000, per_decode_us=500, per_prefill_us=30)
    engine = engine_from_flags(["--max-num-seqs", "12", "--max-num-active-seqs", "8"])
    lines: list[dict] = []
    start = ramp = 0
    for i, (name, seconds) in enumerate(PLAYS):
        name = case if i == 3 else name
        w = load_workload(WORKLOADS / f"{name}.yaml").workload
        if seconds:
            w = w.model_copy(update={"duration": seconds * 10**9})
        trace = tmp_path / f"{i}.jsonl"
        simulate(w, engine, WORKLOADS / "oos-policy.yaml", model, trace=trace)
        play = [r for r in read_trace(trace) if "step" in r]
        t0, step = play[0]["t"], len(lines)
        ramp = start if i == 3 else ramp
        for r in play:
            lines.append(
                {**r, "t": start + r["t"] - t0, "step": r["step"] - play[0]["step"] + step}
            )
        start = lines[-1]["t"] + 2 * 10**9
    span = lines[-1]["t"] - ramp
    for r in lines:
        if r["t"] > ramp:
            x = r["t"] - ramp
            r["t"] = ramp + round(x + (slower - 1) * x * x / (2 * span))
    combined = tmp_path / f"trace-{slower}.jsonl"
    combined.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return combined


@pytest.mark.parametrize("slower", [1.0, 1.25])
def test_the_judge_tells_the_machine_from_the_model(tmp_path, capsys, slower):
    trace = _trace(tmp_path, slower)
    assert len(carry_over.plays(list(read_trace(trace)))) == len(PLAYS)
    assert carry_over.main([str(trace)]) == 0
    printed = capsys.readouterr().out
    print(printed)
    number = r" +([-+][\d.]+)%"
    found = re.search(
        rf"oos-hog +raw{number} +probe before{number} +after{number} +model{number}", printed
    )
    assert found is not None
    raw, before, after, model = (float(x) / 100 for x in found.groups())
    # The machine's move, read without a model: none before the case (the
    # calibration's end), most of it by the probe after.
    assert abs(before) <= 0.02
    assert 0.9 * (slower - 1) - 0.02 <= after <= slower - 1 + 0.02
    assert abs(model) <= 0.05  # the model is the engine: it carries over
    assert raw <= 0.02 - (slower - 1) * 0.3  # the case itself ran slower than the model


def test_a_warm_up_run_into_the_calibration_is_cut_off(tmp_path, capsys):
    """The module run alone starts its calibration right after the warm-up,
    with no idle gap: the calibration is read as the last 15 s of both."""
    trace = _trace(tmp_path, 1.0)
    lines = list(read_trace(trace))
    cut = carry_over.plays(lines)
    gap = cut[1][0]["t"] - cut[0][-1]["t"] - 10**7  # the warm-up ends 10 ms before
    for r in cut[0]:
        r["t"] += gap
    joined = tmp_path / "joined.jsonl"
    joined.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert len(carry_over.plays(list(read_trace(joined)))) == len(PLAYS) - 1
    assert carry_over.main([str(joined)]) == 0
    printed = capsys.readouterr().out
    assert "skipped" not in printed
    found = re.search(r"oos-hog +raw +([-+][\d.]+)%", printed)
    assert found is not None and abs(float(found.group(1))) <= 5


def test_a_warm_up_cut_in_two_is_left_out(tmp_path, capsys):
    """An idle gap inside the warm-up (a make test run: 1.5 s, then 0.7 s)
    makes one play more before the calibration: the calibration is still
    the play two before the first case. Read as the second play, the run
    was skipped ("no case was played")."""
    trace = _trace(tmp_path, 1.0)
    lines = list(read_trace(trace))
    warm = carry_over.plays(lines)[0]
    half = warm[len(warm) // 2]["t"]
    for r in lines:
        if r["t"] < half:
            r["t"] -= 2 * 10**9  # the warm-up's first half ends 2 s earlier: a gap
    split = tmp_path / "split.jsonl"
    split.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert len(carry_over.plays(list(read_trace(split)))) == len(PLAYS) + 1
    assert carry_over.main([str(split)]) == 0
    printed = capsys.readouterr().out
    assert "skipped" not in printed
    found = re.search(r"oos-hog +raw +([-+][\d.]+)%", printed)
    assert found is not None and abs(float(found.group(1))) <= 5


def test_rates_replays_the_tests_scheduling_check(tmp_path, capsys):
    """--rates on a trace the simulator wrote (no machine to take out): every
    user's tok/s simulated at its own steps' length is the engine's, the
    reader's (unlimited: its rate is the step length's) included. What the
    user's own length reads is tested in tests/test_simulate.py; on the
    engine's traces, docs/simulate.md ("Out of sample")."""
    trace = _trace(tmp_path, 1.0, "oos-interactive")
    assert carry_over.main(["--rates", str(trace)]) == 0
    printed = capsys.readouterr().out
    print(printed)
    own = dict(
        re.findall(r"oos-interactive +(\S+) +largest \|error\|: .*, its own ([\d.]+)%", printed)
    )
    assert set(own) == {"chat", "member-1", "member-2", "member-3", "reader"}, printed
    assert all(float(x) <= 2 for x in own.values()), printed


def test_a_case_the_test_does_not_play_is_told_by_its_users(tmp_path, capsys):
    """oos-prefix (`--play N --cases oos-prefix,...`): its single user tells
    the play from oos-interactive and oos-mix, which have the tier too, and
    the model, the engine here, carries over to it. An unknown case is
    refused before anything plays."""
    trace = _trace(tmp_path, 1.0, "oos-prefix")
    assert carry_over.main([str(trace)]) == 0
    printed = capsys.readouterr().out
    found = re.search(r"oos-prefix +raw +[-+][\d.]+% .* model +([-+][\d.]+)%", printed)
    assert found is not None and abs(float(found.group(1))) <= 5, printed
    with pytest.raises(SystemExit) as refused:
        carry_over.main(["--play", "1", "--cases", "oos-hog,oos-nope"])
    assert refused.value.code == 2
    assert "--cases: unknown 'oos-nope'" in capsys.readouterr().err
