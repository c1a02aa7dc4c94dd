"""The simulator on the real vLLM scheduler: what the engine does to users
(limits, holds, max_streams, displacement, KV preemption), that outrate
with nothing to limit is stock vLLM step for step, and that calibration
recovers a step model from a trace the scheduler itself wrote."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from outrate.observe.trace import read_trace  # noqa: E402
from outrate.simulate.engine import EngineSpec, engine_from_flags  # noqa: E402
from outrate.simulate.stepmodel import StepModel  # noqa: E402
from outrate.simulate.tracefit import calibrate, time_error  # noqa: E402
from outrate.simulate.workload import parse_workload  # noqa: E402
from vllm_integration.offline.simulator import simulate  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL = StepModel(fixed_us=2000, per_decode_us=100, per_prefill_us=10)


def workload(users: str, duration: str = "5s", seed: int = 1):
    return parse_workload(f"version: 1\nduration: {duration}\nseed: {seed}\nusers:\n{users}", "w")


def policy(tmp_path: Path, text: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\ndefault: unlimited\nburst: 100ms\n" + text)
    return str(path)


def engine(*flags: str, kv: int | None = None) -> EngineSpec:
    return engine_from_flags(list(flags), kv_cache_tokens=kv)


def test_a_limited_user_gets_its_rate_and_the_others_are_untouched(tmp_path):
    w = workload(
        "  alice: {streams: 8, prompt: 50, output: 400}\n"
        "  bob: {streams: 2, prompt: 50, output: 400}\n"
    )
    limited = simulate(
        w, engine("--max-num-seqs", "16"), policy(tmp_path, "users:\n  alice: 40\n"), MODEL
    )
    stock = simulate(w, engine("--max-num-seqs", "16"), None, MODEL)
    a, b = limited.users["alice"], limited.users["bob"]
    assert 38 <= a.rate <= 42  # (W + burst) * rate + 1 over ~5 s
    assert a.held_share > 0.8 and b.held_share == 0  # alice's streams wait held, keeping KV
    assert stock.users["alice"].rate > 10 * a.rate
    # bob's steps get shorter without alice's 8 decodes in every batch
    assert b.rate > stock.users["bob"].rate * 1.2
    assert b.gap_p50 is not None and b.gap_p50 < stock.users["bob"].gap_p50


def test_with_nothing_to_limit_outrate_is_stock_vllm_token_for_token(tmp_path):
    w = workload(
        "  a: {streams: 6, prompt: {uniform: [20, 300]}, output: {uniform: [10, 60]}}\n"
        "  b: {rate: 20, prompt: 100, output: 30}\n",
        duration="4s",
    )
    e = engine("--max-num-seqs", "8", "--max-num-batched-tokens", "256", kv=4096)
    ours = simulate(w, e, policy(tmp_path, ""), MODEL)
    stock = simulate(w, e, None, MODEL)
    for user in ("a", "b"):
        assert ours.users[user].token_times == stock.users[user].token_times
        assert ours.users[user].completed == stock.users[user].completed > 5
    assert ours.engine.steps == stock.engine.steps
    assert ours.engine.timeline.kv == stock.engine.timeline.kv


def test_max_streams_defers_admissions_without_blocking_others(tmp_path):
    w = workload(
        "  hog: {streams: 12, prompt: 20, output: 50}\n  bob: {rate: 5, prompt: 20, output: 10}\n"
    )
    pol = policy(tmp_path, "users:\n  hog: {rate: unlimited, max_streams: 3}\n")
    r = simulate(w, engine("--max-num-seqs", "8"), pol, MODEL)
    hog, bob = r.users["hog"], r.users["bob"]
    assert hog.deferred >= 9  # 12 streams, 3 at a time: the others wait their turn
    steps_per_s = r.engine.steps / r.engine.seconds
    assert 2.9 * steps_per_s < hog.rate <= 3.01 * steps_per_s  # 3 streams, a token a step
    assert bob.deferred == 0 and bob.ttft_p99 is not None and bob.ttft_p99 < 20_000_000


def test_held_requests_give_way_the_seeds_open_question(tmp_path):
    """A throttled hog with 3x max-num-seqs streams: its requests are held or
    their admission deferred (a seat stays free for users with budget), and
    bob's first tokens come at once; in stock vLLM bob waits for the hog."""
    w = workload(
        "  hog: {streams: 24, prompt: 32, output: 200}\n"
        "  bob: {streams: 1, think: 200ms, prompt: 32, output: 16, start: 1s}\n",
        duration="8s",
    )
    pol = policy(tmp_path, "users:\n  hog: 20\n")
    fair = simulate(w, engine("--max-num-seqs", "8", "--max-num-active-seqs", "6"), pol, MODEL)
    stock = simulate(w, engine("--max-num-seqs", "8"), None, MODEL)
    hog = fair.users["hog"]
    assert hog.deferred > 0 and hog.held_share > 0.2 and 18 < hog.rate < 22
    assert fair.users["bob"].completed >= 15
    assert fair.users["bob"].ttft_p50 is not None and fair.users["bob"].ttft_p50 < 30_000_000
    assert stock.users["bob"].ttft_p50 is not None
    assert stock.users["bob"].ttft_p50 > 10 * fair.users["bob"].ttft_p50


def test_kv_pressure_preempts_and_held_requests_go_first(tmp_path):
    w = workload(
        "  a: {streams: 4, prompt: 200, output: 300}\n"
        "  b: {streams: 4, prompt: 200, output: 300}\n",
        duration="6s",
    )
    small = engine("--max-num-seqs", "8", kv=2000)
    stock = simulate(w, small, None, MODEL)
    assert stock.engine.kv_preemptions > 0 and max(stock.engine.timeline.kv) > 0.9
    limited = simulate(w, small, policy(tmp_path, "users:\n  a: 5\n"), MODEL)
    assert limited.users["b"].completed > stock.users["b"].completed
    assert limited.users["a"].held_share > 0.3 and limited.engine.kv_preemptions > 0
    assert limited.users["b"].ttft_p99 < stock.users["b"].ttft_p99


def test_async_scheduling_runs_one_step_behind(tmp_path):
    w = workload("  a: {streams: 4, prompt: 30, output: 100}\n", duration="3s")
    pol = policy(tmp_path, "users:\n  a: 200\n")
    sync = simulate(w, engine("--max-num-seqs", "8"), pol, MODEL)
    asyn = simulate(w, engine("--max-num-seqs", "8", "--async-scheduling"), pol, MODEL)
    assert 180 < asyn.users["a"].rate < 220 and 180 < sync.users["a"].rate < 220
    assert asyn.users["a"].completed > 0 and sync.users["a"].completed > 0


def test_calibration_recovers_the_model_from_the_schedulers_own_trace(tmp_path):
    truth = StepModel(fixed_us=3000, per_decode_us=200, per_prefill_us=15)
    w = workload(
        "  a: {streams: 6, ramp: 2s, think: {exponential: 100ms}, prompt: 300,"
        " output: {uniform: [20, 200]}}\n"
        "  b: {rate: 15, prompt: 500, output: 5}\n",
        duration="10s",
    )
    trace = tmp_path / "trace.jsonl"
    simulate(w, engine("--max-num-seqs", "16"), policy(tmp_path, ""), truth, trace=trace)
    cal = calibrate(read_trace(trace), w)
    m = cal.model
    assert abs(m.fixed_us - 3000) < 300, cal.describe()
    assert abs(m.per_decode_us - 200) < 30, cal.describe()
    assert abs(m.per_prefill_us - 15) < 3, cal.describe()
    assert m.turnaround_us < 20_000  # the simulator has none: a few steps of noise
    without = calibrate(read_trace(trace))
    assert without.model.per_prefill_us == StepModel().per_prefill_us and not without.prefill_fitted


def _stepped_and_fitted(tmp_path: Path, w, policy_text: str, truth: StepModel):
    """`w` simulated under the policy with steps as long as `truth` says
    (`--max-num-seqs 16`), and the model calibrated on its trace: (the
    trace's path, the calibration)."""
    trace = tmp_path / "trace.jsonl"
    pol = policy(tmp_path, policy_text)
    simulate(w, engine("--max-num-seqs", "16"), pol, truth, trace=trace)
    return trace, calibrate(read_trace(trace), w)


def test_the_wake_cost_after_an_idle_step_is_simulated_and_recovered(tmp_path):
    """A throttled user leaves the engine idle between its tokens: the step
    after each wait costs `wake_us` more in the simulator, and calibrating
    on the simulator's trace finds that cost (and the rest) again. Without
    the term, a model of the same trace is short by the wake steps' share."""
    truth = StepModel(fixed_us=3000, per_decode_us=200, per_prefill_us=15, wake_us=2000)
    w = workload(
        "  a: {streams: 2, think: {exponential: 1s}, prompt: 300,"
        " output: {uniform: [20, 200]}}\n"
        "  slow: {streams: 3, prompt: 50, output: 100}\n",
        duration="10s",
    )
    trace, cal = _stepped_and_fitted(tmp_path, w, "users:\n  slow: 40\n", truth)
    m = cal.model
    assert abs(m.wake_us - 2000) < 300, cal.describe()
    assert abs(m.fixed_us - 3000) < 300, cal.describe()
    assert abs(m.per_decode_us - 200) < 30, cal.describe()
    no_wake = StepModel(fixed_us=3000, per_decode_us=200, per_prefill_us=15)
    assert time_error(no_wake, read_trace(trace), w) < -0.04, cal.describe()
    assert abs(time_error(truth, read_trace(trace), w)) < 0.02


def test_the_cost_of_holding_a_request_is_simulated_and_recovered(tmp_path):
    """Throttled users with several streams each are held and released all
    the time beside an unlimited one: each step costs `per_held_us` more
    for each request it holds in the simulator, and calibrating on the
    simulator's trace finds that cost (and the rest) again. A model without
    it is short by the holds' share of the time."""
    truth = StepModel(fixed_us=3000, per_decode_us=200, per_prefill_us=15, per_held_us=500)
    w = workload(
        "  open: {streams: 2, prompt: 60, output: {uniform: [20, 200]}}\n"
        "  m: {count: 3, streams: 3, prompt: 40, output: 60}\n",
        duration="10s",
    )
    limits = "users:\n  m-1: 25\n  m-2: 25\n  m-3: 25\n"
    trace, cal = _stepped_and_fitted(tmp_path, w, limits, truth)
    lines = read_trace(trace)
    held = sum(sum(r.get("held", {}).values()) for r in lines if "step" in r)
    assert held > 200, held  # the throttled streams rotate through holds
    m = cal.model
    assert abs(m.per_held_us - 500) < 50, cal.describe()
    assert abs(m.per_decode_us - 200) < 30, cal.describe()
    assert f"+ {m.per_held_us:g}us/request held" in m.describe()
    without = replace(truth, per_held_us=0)
    assert time_error(without, lines, w) < -0.03, cal.describe()
    assert abs(time_error(truth, lines, w)) < 0.02
    # the same trace with its holds left out: the cost cannot be sized, so
    # it is kept (and said), and it prices nothing there
    unheld = [{k: v for k, v in r.items() if k != "held"} for r in lines]
    assert time_error(truth, unheld, w) == time_error(without, unheld, w)
    kept = calibrate(unheld, w, base=replace(StepModel(), per_held_us=123))
    assert kept.model.per_held_us == 123 and "hold cost kept" in kept.describe()


def test_how_the_wake_cost_grows_with_the_wait_is_recovered(tmp_path):
    """Throttled users alone one after another, at three rates: the engine
    waits ~30, ~9 and ~2 ms between their tokens. Stepped with a wake cost
    that grows with the wait (time constant 8 ms), the fit finds that time
    constant among those it tries, and the cost; a model charging all of it
    after every wait is long on these steps."""
    truth = StepModel(
        fixed_us=2000, per_decode_us=200, per_prefill_us=15, wake_us=2000, wake_tau_us=8000
    )
    w = workload(
        "  busy: {streams: 3, prompt: 50, output: 100, stop: 3s}\n"
        "  slow: {streams: 1, prompt: 20, output: 15, start: 3s, stop: 6s}\n"
        "  mid: {streams: 1, prompt: 20, output: 20, start: 6s, stop: 9s}\n"
        "  quick: {streams: 1, prompt: 20, output: 40, start: 9s}\n",
        duration="12s",
    )
    trace, cal = _stepped_and_fitted(
        tmp_path, w, "users:\n  slow: 30\n  mid: 80\n  quick: 200\n", truth
    )
    m = cal.model
    assert m.wake_tau_us == 8000 and abs(m.wake_us - 2000) < 300, cal.describe()
    assert "e^(-wait/8ms)" in cal.describe()
    flat = replace(truth, wake_tau_us=0)
    assert time_error(flat, read_trace(trace), w) > 0.03
    assert abs(time_error(truth, read_trace(trace), w)) < 0.02


def test_the_step_length_error_over_one_users_steps(tmp_path):
    """time_error(..., user) reads only the steps that charged that user: a
    trace whose steps with b in them ran 1.5x the model reads -1/3 for b,
    and about that share of it over every step."""
    model = StepModel(fixed_us=3000, per_decode_us=200, per_prefill_us=15)
    w = workload(
        "  a: {streams: 2, prompt: 30, output: 100}\n"
        "  b: {streams: 1, think: {exponential: 1s}, prompt: 30, output: 20}\n",
        duration="6s",
    )
    trace = tmp_path / "trace.jsonl"
    simulate(w, engine("--max-num-seqs", "8"), policy(tmp_path, ""), model, trace=trace)
    lines, shift, before = [], 0, None
    for r in read_trace(trace):
        if "t" in r and "step" in r:
            if before is not None and before.get("charged", {}).get("b"):
                shift += (r["t"] - before["t"]) // 2  # that step, half as long again
            before = r
            r = {**r, "t": r["t"] + shift}
        lines.append(r)
    assert abs(time_error(model, lines, w, "b") + 1 / 3) < 0.01
    assert abs(time_error(model, lines, w, "a")) < abs(time_error(model, lines, w, "b"))
    assert time_error(model, lines, w) < -0.01
    assert abs(time_error(model, read_trace(trace), w, "b")) < 0.01


def test_a_turnaround_delays_each_streams_next_request(tmp_path):
    w = workload("  a: {streams: 1, prompt: 10, output: 10}\n", duration="2s")
    quick = simulate(w, engine(), None, MODEL)
    slow = simulate(w, engine(), None, StepModel(2000, 100, 10, turnaround_us=100_000))
    cycle = 10 * MODEL.step_ns(1, 0) + 100_000_000
    assert slow.users["a"].completed == pytest.approx(2e9 / cycle, abs=1)
    assert quick.users["a"].completed > 2 * slow.users["a"].completed


def test_a_long_run_reports_progress_and_ctrl_c_keeps_what_was_simulated(tmp_path):
    w = workload("  a: {streams: 4, prompt: 20, output: 50}\n", duration="3600s")
    seen: list[tuple[int, int]] = []

    def progress(now_ns: int, done: int) -> None:
        seen.append((now_ns, done))
        if len(seen) == 2:
            raise KeyboardInterrupt  # what Ctrl-C raises in the loop

    result = simulate(w, engine(), None, MODEL, progress=progress)
    assert seen[0][0] < seen[1][0] < 3600e9 and seen[1][1] >= seen[0][1]
    assert result.partial.startswith("stopped at ") and result.partial.endswith(
        "of 3600s simulated"
    )
    assert result.users["a"].rate > 0 and result.engine.seconds < 3600
    from outrate.simulate.report import format_run

    assert "== PARTIAL: stopped at" in format_run(result)


def test_a_trace_where_every_step_follows_a_wait_keeps_the_wake_cost(tmp_path):
    """One throttled user alone: every step that ran follows one that held
    it, so the wake cost cannot be told from the fixed cost; the fit keeps
    it (and says so) instead of failing on a singular system."""
    truth = StepModel(fixed_us=3000, per_decode_us=200, per_prefill_us=15, wake_us=2000)
    w = workload("  slow: {streams: 2, prompt: 50, output: 100}\n", duration="10s")
    trace = tmp_path / "trace.jsonl"
    simulate(w, engine(), policy(tmp_path, "users:\n  slow: 20\n"), truth, trace=trace)
    cal = calibrate(read_trace(trace), w)
    assert cal.model.wake_us == 0 and "wake cost kept" in cal.describe(), cal.describe()
