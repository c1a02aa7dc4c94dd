"""`outrate simulate` from the command line: the run, compare, sweep, plots
and JSON; calibrate and schema; errors before vLLM is imported; the docs'
example regenerated (docs/simulate.md and its PNG); the benchmark's smoke run."""

from __future__ import annotations

import json
import random
import re
import struct
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from outrate.cli import app
from outrate.errors import OutrateError
from outrate.simulate.stepmodel import StepModel, load_step_model
from outrate.simulate.tracefit import calibrate

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "examples" / "workloads"
DOC = REPO / "docs" / "simulate.md"
PNG = REPO / "docs" / "simulate-example.png"
runner = CliRunner()
SMALL = (
    "version: 1\nduration: 3s\nusers:\n"
    "  a: {streams: 3, prompt: 20, output: 40}\n  b: {rate: 4, prompt: 30, output: 10}\n"
)


def cli(*args: str):
    return runner.invoke(app, ["simulate", *args])


@pytest.fixture
def files(tmp_path):
    w = tmp_path / "load.yaml"
    w.write_text(SMALL)
    p = tmp_path / "policy.yaml"
    p.write_text("version: 1\ndefault: unlimited\nusers:\n  a: 50\n")
    return w, p


# -- without vLLM -------------------------------------------------------------


def test_schema_prints_the_shipped_schema():
    result = cli("schema")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == json.loads((WORKLOADS / "workload.schema.json").read_text())


def test_a_bad_workload_fails_with_its_location(tmp_path, files):
    _, policy = files
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nduration: 3s\nusers:\n  a: {streams: 3, prompt: 20}\n")
    result = cli(str(policy), "-w", str(bad))
    assert result.exit_code == 1
    assert f"{bad}:4:6: users.a.output: missing; the output length in tokens" in result.stderr


def test_a_bad_policy_fails_like_lint_says(tmp_path, files):
    workload, _ = files
    bad = tmp_path / "p.yaml"
    bad.write_text("version: 1\ndefault: -3\n")
    result = cli(str(bad), "-w", str(workload))
    assert result.exit_code == 1
    assert f"{bad}:2:10: default: must be > 0" in result.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--", "--max-num-seqz", "8"],
            "unrecognized vllm serve flag (did you mean '--max-num-seqs'?)",
        ),
        (["--", "--speculative-config", '{"method": "ngram"}'], "speculative"),
        (["--", "--max-num-seqs", "4", "--max-num-active-seqs", "8"], "must not exceed"),
        (["--sweep", "max-num-seqs"], "expected FLAG=V1,V2"),
        (["--sweep", "max-num-seqs=4", "--compare", "stock"], "at most one of"),
        (["--", "--scheduling-policy", "lifo"], "must be fcfs or priority"),
    ],
)
def test_bad_engine_options_fail_before_any_run(files, extra, message):
    workload, policy = files
    result = cli(str(policy), "-w", str(workload), *extra)
    assert result.exit_code == 1, result.output
    assert message in result.stderr


def _synthetic_trace(path: Path, truth: StepModel, seed: int = 4) -> None:
    """A trace whose steps last what `truth` says (plus noise): users start
    requests (prompt 200) and decode; the calibration must find `truth`."""
    rng = random.Random(seed)
    t, lines = 10**12, [{"trace": "outrate", "version": 1}]
    running = {"u1": 0, "u2": 0}
    for step in range(1, 3000):
        new = {}
        for u in running:
            if rng.random() < 0.05 and running[u] < 12:
                new[u] = rng.randint(1, 2)
            if rng.random() < 0.05 and running[u] > 1:
                running[u] -= 1
        charged = {u: running[u] + new.get(u, 0) for u in running if running[u] + new.get(u, 0)}
        decode = sum(running.values())
        prefill = 200 * sum(new.values())
        for u, k in new.items():
            running[u] += k
        lines.append({"t": t, "step": step, **({"charged": charged} if charged else {})})
        t += int(truth.step_ns(decode, prefill) * rng.uniform(0.9, 1.1))
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_calibrate_finds_the_model_a_trace_was_made_with(tmp_path):
    truth = StepModel(fixed_us=5000, per_decode_us=120, per_prefill_us=30)
    trace = tmp_path / "trace.jsonl"
    _synthetic_trace(trace, truth)
    workload = tmp_path / "load.yaml"
    workload.write_text(
        "version: 1\nduration: 9s\nusers:\n"
        "  u1: {rate: 1, prompt: 200, output: 9}\n  u2: {rate: 1, prompt: 200, output: 9}\n"
    )
    out = tmp_path / "model.json"
    result = cli("calibrate", "--trace", str(trace), "-w", str(workload), "-o", str(out))
    assert result.exit_code == 0, result.output
    model = load_step_model(out)
    assert model.fixed_us == pytest.approx(5000, rel=0.05)
    assert model.per_decode_us == pytest.approx(120, rel=0.1)
    assert model.per_prefill_us == pytest.approx(30, rel=0.15)
    assert "fitted on" in result.stdout
    bare = cli("calibrate", "--trace", str(trace), "--format", "json")
    data = json.loads(bare.stdout)
    assert data["model"]["per_prefill_us"] == StepModel().per_prefill_us
    assert not data["prefill_fitted"] and "pass the workload" in data["notes"][0]


def test_calibrate_refuses_what_it_cannot_fit(tmp_path):
    empty = tmp_path / "t.jsonl"
    empty.write_text('{"trace": "outrate"}\n')
    result = cli("calibrate", "--trace", str(empty))
    assert result.exit_code == 1 and "fewer than 10 steps" in result.stderr
    missing = cli("calibrate", "--trace", str(tmp_path / "none.jsonl"))
    assert missing.exit_code == 1 and "cannot read" in missing.stderr


def test_a_fit_never_goes_negative():
    # steps that get shorter as the batch grows: the decode cost is pinned at 0
    lines, t = [], 0
    for step in range(60):
        batch = 1 + step % 5
        lines.append({"t": t, "step": step, "charged": {"a": batch}})
        t += 1_000_000 - 100_000 * batch
    cal = calibrate(lines)
    assert cal.model.per_decode_us == 0 and 600 < cal.model.fixed_us < 900


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "invalid JSON"),
        ('{"wake_tau_us": -1}', "wake_tau_us: must be a number >= 0"),
        ('{"fixed_us": -1}', "fixed_us: must be a number >= 0"),
        ('{"wake_us": true}', "wake_us: must be a number >= 0"),
        ('{"per_held_us": "1"}', "per_held_us: must be a number >= 0"),
        ('{"fixd_us": 1}', "unknown key 'fixd_us'"),
        ("[1]", "expected a JSON object"),
    ],
)
def test_a_bad_step_model_file_is_refused(tmp_path, files, text, message):
    workload, policy = files
    model = tmp_path / "m.json"
    model.write_text(text)
    result = cli(str(policy), "-w", str(workload), "--step-model", str(model))
    assert result.exit_code == 1 and message in result.stderr


# -- runs (vLLM) ----------------------------------------------------------------


def _table_users(text: str) -> dict[str, list[str]]:
    return {
        line.split()[0]: line.split() for line in text.splitlines() if re.match(r"^[ab] ", line)
    }


@pytest.mark.vllm
def test_run_prints_the_table_and_json_has_every_figure(files):
    pytest.importorskip("vllm")
    workload, policy = files
    text = cli(str(policy), "-w", str(workload), "--", "--max-num-seqs", "8")
    assert text.exit_code == 0, text.output
    rows = _table_users(text.stdout)
    assert set(rows) == {"a", "b"} and 45 <= float(rows["a"][1]) <= 55  # a: 50 tok/s
    assert "engine: " in text.stdout and "step = 7000us" in text.stdout
    out = cli(str(policy), "-w", str(workload), "--format", "json", "--", "--max-num-seqs", "8")
    data = json.loads(out.stdout)
    (run,) = data["runs"]
    figures = {"tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms"}
    assert set(run["users"]["a"]) >= figures | {"held_share", "deferred", "completed"}
    assert run["users"]["a"]["tokens_per_s"] == pytest.approx(float(rows["a"][1]), abs=0.06)
    assert run["engine"]["steps"] > 0 and "max-num-seqs 8" in run["engine_config"]


@pytest.mark.vllm
def test_compare_and_sweep_run_the_same_workload_per_configuration(tmp_path, files):
    pytest.importorskip("vllm")
    workload, policy = files
    both = cli(
        str(policy), "-w", str(workload), "--compare", "stock", "--plot", str(tmp_path / "p")
    )
    assert both.exit_code == 0, both.output
    assert "== A: policy.yaml" in both.stdout and "== B: stock" in both.stdout
    a_row = next(line for line in both.stdout.splitlines() if line.startswith("a "))
    assert "->" in a_row and "(+" in a_row  # unthrottled, a gets more
    for name in ("tokens.png", "gaps.png", "engine.png"):
        assert (tmp_path / "p" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    flags = cli(str(policy), "-w", str(workload), "--compare-flags", "--max-num-seqs 2")
    assert flags.exit_code == 0 and "-- --max-num-seqs 2" in flags.stdout
    sweep = cli(str(policy), "-w", str(workload), "--format", "json", "--sweep", "max-num-seqs=1,4")
    runs = json.loads(sweep.stdout)["runs"]
    assert [r["label"].rsplit("| ", 1)[1] for r in runs] == ["max-num-seqs=1", "max-num-seqs=4"]
    assert runs[0]["engine"]["batch_max"] == 1 and runs[1]["engine"]["batch_max"] > 1


def _png_size(data: bytes) -> tuple[int, int]:
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.vllm
def test_the_docs_example_is_what_the_command_prints(tmp_path, monkeypatch):
    """docs/simulate.md shows the command, its table and its plot: rerun the
    command, and the text must be the same (the simulation is deterministic)
    and the plot of this run must be drawn, the size of the committed one."""
    pytest.importorskip("vllm")
    monkeypatch.chdir(REPO)  # the docs name the files from the repository's root
    doc = DOC.read_text()
    command = re.search(r"```\n(outrate simulate .*?--compare stock.*?)\n```", doc, re.S)
    assert command is not None
    args = command.group(1).replace("\\\n", " ").split()[2:]
    args[args.index("--plot") + 1] = str(tmp_path)
    result = runner.invoke(app, ["simulate", *args])
    assert result.exit_code == 0, result.output
    assert f"```\n{result.stdout}```" in doc
    readme = (REPO / "README.md").read_text()  # "Plan before you deploy": the same run
    assert f"```\n{command.group(1)}\n```" in readme
    assert f"```\n{result.stdout}```" in readme
    workload = (REPO / "examples" / "workloads" / "alice-48.yaml").read_text()
    assert f"```yaml\n{workload.split(chr(10), 1)[1]}```" in readme  # (less its first comment)
    drawn = (tmp_path / "tokens.png").read_bytes()
    committed = PNG.read_bytes()
    assert _png_size(drawn) == _png_size(committed)
    assert len(committed) < 100_000


@pytest.mark.vllm
def test_the_docs_peak_example_is_what_the_command_prints(monkeypatch):
    """docs/simulate.md "With a peak" (README "Plan before you deploy" links
    it), work-conserving (issue 33): alice {rate: 200, peak: unlimited}
    beside bob and carol. The text is the command's, and what it claims
    holds: the engine runs at least 0.9x stock, and bob's and carol's first
    tokens come within 2x of the capped policy's."""
    pytest.importorskip("vllm")
    monkeypatch.chdir(REPO)
    doc = DOC.read_text()
    command = re.search(r"```\n(outrate simulate \S*plan-peak-policy.yaml .*?)\n```", doc, re.S)
    assert command is not None
    args = command.group(1).replace("\\\n", " ").split()[2:]
    result = runner.invoke(app, ["simulate", *args])
    assert result.exit_code == 0, result.output
    assert f"```\n{result.stdout}```" in doc
    flags = args[args.index("--") :]
    peak, capped = args[0], args[args.index("--compare") + 1]
    runs = {}
    for name, compare in (("stock", "stock"), ("capped", capped)):
        out = runner.invoke(app, ["simulate", peak, *args[1:3], "--compare", compare,
                                  "--format", "json", *flags])  # fmt: skip
        assert out.exit_code == 0, out.output
        runs[name] = json.loads(out.stdout)["runs"]
    lent, stock = runs["stock"][0], runs["stock"][1]
    assert lent["engine"]["tokens_per_s"] >= 0.9 * stock["engine"]["tokens_per_s"]
    for user in ("bob", "carol"):
        mine, theirs = runs["capped"][0]["users"][user], runs["capped"][1]["users"][user]
        assert mine["ttft_p50_ms"] <= 2 * theirs["ttft_p50_ms"], user


@pytest.mark.vllm
def test_the_benchmark_smoke_runs():
    pytest.importorskip("vllm")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_simulate

    assert bench_simulate.main(["--seconds", "2"]) == 0


@pytest.mark.vllm
def test_the_benchmark_times_a_step_of_a_workload(capsys):
    pytest.importorskip("vllm")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_simulate

    w = REPO / "examples" / "workloads"
    flags = ["--max-num-seqs", "12", "--max-num-active-seqs", "8"]
    assert (
        bench_simulate.main(
            ["--steps", str(w / "oos-hog.yaml"), str(w / "oos-policy.yaml")] + flags
        )
        == 0
    )
    assert re.search(r"\d+ steps, schedule\(\) median \d+ us, mean \d+ us", capsys.readouterr().out)


# -- the simulator states its size and its error (issue 36) ----------------------


def test_calibrate_prints_its_residuals_and_the_model_file_says_how_it_was_fitted(tmp_path):
    truth = StepModel(fixed_us=5000, per_decode_us=120, per_prefill_us=30)
    trace = tmp_path / "trace.jsonl"
    _synthetic_trace(trace, truth)
    out = tmp_path / "model.json"
    result = cli("calibrate", "--trace", str(trace), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert re.search(r"residuals: rms \d+us, \|error\| p50 \d+us, p90 \d+us", result.stdout)
    model = load_step_model(out)
    assert model.fit.startswith("fitted on ") and f"of {trace}" in model.fit
    assert model.provenance() == f"step model {model.fit}"
    assert "not fitted to any engine" in StepModel().provenance()


def test_a_plan_that_would_not_fit_in_memory_is_refused_before_it_runs(tmp_path, files):
    _, policy = files
    huge = tmp_path / "week.yaml"
    huge.write_text(
        "version: 1\nduration: 168h\nusers:\n  a: {rate: 100000, prompt: 100, output: 50}\n"
    )
    result = cli(str(policy), "-w", str(huge))
    assert result.exit_code == 1
    assert "this plan would not fit in memory: about 60,480,000,000 requests" in result.stderr


def test_the_size_estimate_is_near_what_the_docs_example_simulates():
    from outrate.simulate.engine import engine_from_flags
    from outrate.simulate.size import check_fits, size_of
    from outrate.simulate.workload import load_workload

    flags = ["--max-num-seqs", "16", "--max-num-active-seqs", "12"]
    size = size_of(
        load_workload(WORKLOADS / "alice-48.yaml").workload, engine_from_flags(flags), StepModel()
    )
    assert 7000 < size.steps < 8800  # the docs' runs: 7914 and 6736 steps
    assert size.memory_bytes < 100 * 2**20 and size.wall_s < 60
    check_fits(size, available=2**30)
    with pytest.raises(OutrateError, match="would not fit in memory"):
        check_fits(size, available=size.memory_bytes)


@pytest.mark.vllm
def test_calibrate_with_the_policy_simulates_the_run_it_fitted(tmp_path):
    pytest.importorskip("vllm")
    from outrate.simulate.engine import engine_from_flags
    from outrate.simulate.workload import load_workload
    from vllm_integration.offline.simulator import simulate

    workload = tmp_path / "load.yaml"
    workload.write_text(SMALL)
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ndefault: unlimited\nusers:\n  a: 50\n")
    trace = tmp_path / "trace.jsonl"
    truth = StepModel(fixed_us=3000, per_decode_us=200, per_prefill_us=15)
    flags = ["--max-num-seqs", "8"]
    simulate(
        load_workload(workload).workload, engine_from_flags(flags), str(policy), truth, trace=trace
    )
    args = ["--trace", str(trace), "-w", str(workload), "--policy", str(policy), "--", *flags]
    result = cli("calibrate", *args)
    assert result.exit_code == 0, result.output
    assert "in sample: tok/s per user, the trace's and simulated" in result.stdout
    rows = dict(re.findall(r"^  (\w+): .*\(([-+][\d.]+)%\)$", result.stdout, re.M))
    assert set(rows) == {"a", "b"} and all(abs(float(v)) < 5 for v in rows.values()), result.stdout
    assert "plan: about" not in result.stdout  # the table is stdout's alone
