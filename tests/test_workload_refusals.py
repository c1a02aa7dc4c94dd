"""Workloads `outrate simulate` refuses, and how it says so: in seconds, with
a located line, and as a JSON error object where JSON was asked for.

A user with `rate: 1e-300` (open loop) ran ~15 s, then died with a
ZeroDivisionError in simulate/plan.py (the mean gap overflowed to inf);
`--format json` with a bad workload printed nothing on stdout."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from outrate.cli import app
from outrate.simulate.plan import plan
from outrate.simulate.values import MIN_REQUEST_RATE
from outrate.simulate.workload import WorkloadError, load_workload

runner = CliRunner()


def _workload(tmp_path: Path, rate: str, duration: str = "10s") -> Path:
    path = tmp_path / "load.yaml"
    path.write_text(
        f"version: 1\nduration: {duration}\nusers:\n  a: {{rate: {rate}, prompt: 10, output: 10}}\n"
    )
    return path


TOO_SLOW = (
    "must be at least 0.000001 requests per second (one request in about 12 days; "
    "the longest run is a week)"
)


@pytest.mark.parametrize("rate", ["1e-300", "5e-301", "0.0000009", "1/3000000"])
def test_a_vanishing_rate_is_a_located_error_at_once(tmp_path: Path, rate: str) -> None:
    path = _workload(tmp_path, rate)
    started = time.monotonic()
    result = runner.invoke(app, ["simulate", "stock", "-w", str(path)])
    took = time.monotonic() - started
    assert result.exit_code == 1, result.output
    if "/" in rate:  # a fraction is no workload rate: it says so
        assert "users.a.rate: must be a number of requests per second > 0" in result.stderr
    else:
        assert result.stderr == f"{path}:4:13: users.a.rate: {TOO_SLOW}\n"
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert took < 5


def test_the_slowest_rate_plans_a_week_in_no_time(tmp_path: Path) -> None:
    """At the floor the gap is a million seconds: a plan, not an overflow."""
    assert MIN_REQUEST_RATE == 0.000001
    workload = load_workload(_workload(tmp_path, "0.000001", "168h")).workload
    started = time.monotonic()
    planned = plan(workload)
    assert time.monotonic() - started < 1
    assert len(planned.arrivals) <= 3 and planned.users == ["a"]
    with pytest.raises(WorkloadError, match="must be at least 0.000001"):
        load_workload(_workload(tmp_path, "0.00000099"))


def test_json_was_asked_for_so_an_error_is_a_json_object(tmp_path: Path) -> None:
    path = _workload(tmp_path, "1e-300")
    result = runner.invoke(app, ["simulate", "stock", "-w", str(path), "--format", "json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {
        "ok": False,
        "errors": [
            {"path": str(path), "line": 4, "col": 13, "field": "users.a.rate", "message": TOO_SLOW}
        ],
    }
    assert result.stderr == f"{path}:4:13: users.a.rate: {TOO_SLOW}\n"  # as in text
    missing = tmp_path / "none.yaml"
    result = runner.invoke(app, ["simulate", "stock", "-w", str(missing), "--format", "json"])
    assert result.exit_code == 1
    (error,) = json.loads(result.stdout)["errors"]
    assert error["field"] == "<file>" and error["message"].startswith("cannot read: ")
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"trace": "outrate"}\n')
    result = runner.invoke(
        app, ["simulate", "calibrate", "--trace", str(trace), "--format", "json"]
    )
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {
        "ok": False,
        "errors": [{"message": f"{trace}: fewer than 10 steps in the trace: nothing to fit"}],
    }
