"""The simulator against a real engine: the same workload on a real `outrate
serve` (tiny model) and on the simulator calibrated from that server's trace.

Bounds (issue 25): each user's engine-side tok/s within 5% of the
simulation; time to first token p50 within 25% or 20 ms (for a user held at
its rate, the mean, with one token interval more: `AT_CAP`). The engine's side
is what it recorded: tokens and rates from its `--outrate-trace`, time to
first token from vLLM's per-request metrics (queue + first token, engine-core
timestamps: `--enable-per-request-metrics`). Then a policy where throttling
matters: a hog with 3x --max-num-seqs streams beside a normal user, whose
time to first token the simulator must show as the engine does (with the
step model of the first run: nothing refitted). And the step model fitted
to vLLM's own counters (`calibrate --metrics`), read from the server's
/metrics during the first run, against the trace's fit of that run.

The server is this module's own (its flags are the simulated engine's)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import sim_servers  # noqa: E402
from e2e_support import use_policy, wait_idle  # noqa: E402
from sim_drift import at_measured  # noqa: E402
from sim_drift import play as play_file  # noqa: E402
from sim_servers import SimServer  # noqa: E402
from workload_player import Played, Player  # noqa: E402

from outrate.errors import OutrateError  # noqa: E402
from outrate.observe.trace import engine_rate, read_trace, user_tokens  # noqa: E402
from outrate.simulate.counters import Reading, scrape_engine  # noqa: E402
from outrate.simulate.engine import engine_from_flags  # noqa: E402
from outrate.simulate.metricsfit import calibrate_metrics  # noqa: E402
from outrate.simulate.report import RunResult  # noqa: E402
from outrate.simulate.stepmodel import StepModel  # noqa: E402
from outrate.simulate.tracefit import calibrate, time_error  # noqa: E402
from outrate.simulate.workload import load_workload  # noqa: E402
from vllm_integration.offline.simulator import simulate  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.quiet]

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "examples" / "workloads"
POLICY = (
    "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  bob: 30\n  hog: 20\n"
    "  lender: {rate: 20, peak: unlimited}\n"
)
ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-active-seqs", "6"]
KV_TOKENS = 256 * 1024 * 1024 // 512  # --kv-cache-memory-bytes 256M at 512 bytes a token
RATE_BOUND = 0.05
TTFT_BOUND, TTFT_SLACK_S = 0.25, 0.020
SCRAPE_INTERVAL_S = 0.5
METRICS_BOUND = 0.10
"""The metrics fit's step length on the run's own steps (`time_error`), and
each user's tok/s simulated with it against the engine's, as a share."""


SIM_SERVER = SimServer(tuple(ENGINE_FLAGS), POLICY)
"""Started with test_simulate_oos's before any test (tests/sim_servers.py)."""


@pytest.fixture(scope="module")
def sim_server(request):
    return sim_servers.sim_server(request)


def play(server, name: str, seconds: int = 0) -> tuple[object, list[Played], list[dict]]:
    """Play a workload of examples/workloads (sim_drift.play)."""
    return play_file(server, WORKLOADS / name, seconds)


@contextmanager
def metrics_read(server, window_s: float) -> Iterator[list[Reading]]:
    """vLLM's counters, read from the server's /metrics every
    SCRAPE_INTERVAL_S for `window_s` (a thread) while the body runs."""
    readings: list[Reading] = []
    failed: list[OutrateError] = []

    def read() -> None:
        try:
            readings.extend(
                scrape_engine(f"{server.root_url}/metrics", window_s, SCRAPE_INTERVAL_S)
            )
        except OutrateError as e:
            failed.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    yield readings
    reader.join(timeout=window_s + 30)
    if failed:
        raise failed[0]


def agree_duration_s() -> float:
    return load_workload(WORKLOADS / "e2e-agree.yaml").workload.duration / 1e9


def engine_ttft_p50(played: list[Played], user: str) -> float:
    return statistics.median(engine_ttfts(played, user))


def sim(workload, model: StepModel, policy: Path) -> RunResult:
    engine = engine_from_flags(ENGINE_FLAGS, kv_cache_tokens=KV_TOKENS)
    return simulate(workload, engine, str(policy), model)


def ttft_agrees(real_s: float, sim_s: float) -> bool:
    return abs(real_s - sim_s) <= max(TTFT_BOUND * real_s, TTFT_SLACK_S)


AT_CAP = {"bob": 30}
"""Users the agreement workload holds at their rate (bob: 2 streams at 30
tok/s), with that rate. Such a user's first token waits for its own budget
behind its other stream: up to two token intervals (2 x 33 ms) after its
prompt, by the limiter's phase when the request comes in. On the engine that
phase is set by the API server's delay, which moved 18-134 ms from request
to request in one run; the simulator returns each stream after the
calibrated mean turnaround. Ten runs on 2-core machines: the engine's
p50 15-47 ms, the simulator's 14-79 ms, landing in either of two humps 33
ms apart; the means of six of them 30-77 ms and 21-64 ms. For these
users the mean is judged, with one token interval (1/rate) added to the
slack: the phase that neither side controls."""


def ttft_mean_agrees(real_s: float, sim_s: float, rate: float) -> bool:
    return abs(real_s - sim_s) <= max(TTFT_BOUND * real_s, TTFT_SLACK_S) + 1 / rate


def engine_ttfts(played: list[Played], user: str) -> list[float]:
    values = [p.engine_ttft_s for p in played if p.user == user and p.engine_ttft_s is not None]
    assert values, f"no per-request metrics for {user}"
    return values


def test_the_simulator_agrees_with_the_engine_it_was_calibrated_on(sim_server):
    with metrics_read(sim_server, agree_duration_s()) as readings:
        workload, played, steps = play(sim_server, "e2e-agree.yaml")
    # The run, for the fit from /metrics (test_a_fit_from_metrics_...).
    sim_server.agree_run = workload, played, steps, readings
    cal = calibrate(steps, workload, source="the server's trace")
    result = sim(workload, cal.model, sim_server.policy_path)
    report = [cal.describe()]
    failures = []
    for user, stats in result.users.items():
        real_rate = engine_rate(user_tokens(steps, user))
        real_ttft = engine_ttft_p50(played, user)
        sim_ttft = (stats.ttft_p50 or 0) / 1e9
        client = statistics.median(p.client_ttft_s for p in played if p.user == user and p.first)
        row = (
            f"{user}: engine {real_rate:.1f} tok/s, simulated {stats.rate:.1f} "
            f"({(stats.rate - real_rate) / real_rate:+.1%}); TTFT p50 engine "
            f"{real_ttft * 1000:.1f} ms, simulated {sim_ttft * 1000:.1f} ms "
            f"(client {client * 1000:.1f} ms)"
        )
        if abs(stats.rate - real_rate) > RATE_BOUND * real_rate:
            failures.append(f"{user}: rate")
        if user in AT_CAP:
            real_mean = statistics.fmean(engine_ttfts(played, user))
            sim_mean = statistics.fmean(stats.ttfts) / 1e9 if stats.ttfts else 0.0
            row += f"; mean engine {real_mean * 1000:.1f} ms, simulated {sim_mean * 1000:.1f} ms"
            if not ttft_mean_agrees(real_mean, sim_mean, AT_CAP[user]):
                failures.append(f"{user}: TTFT mean")
        elif not ttft_agrees(real_ttft, sim_ttft):
            failures.append(f"{user}: TTFT")
        report.append(row)
    print("\n".join(report))
    assert not failures, "\n".join([*failures, *report])
    # The calibrated model is the one the throttling and lending cases use.
    sim_server.step_model = cal.model


def test_a_fit_from_metrics_agrees_with_the_trace_fit(sim_server):
    """Issue 36: the step model fitted to vLLM's own counters, read from the
    server's /metrics every SCRAPE_INTERVAL_S during the agreement run,
    against the trace's fit of the same run: the step length each model
    gives the run's own steps (`time_error`; the trace's fit is ~0 there, in
    sample), and every user's tok/s simulated with it against the engine's,
    each within METRICS_BOUND. Both models printed."""
    run = getattr(sim_server, "agree_run", None)
    if run is None:  # run alone: play the agreement workload, reading /metrics
        with metrics_read(sim_server, agree_duration_s()) as readings:
            workload, played, steps = play(sim_server, "e2e-agree.yaml")
    else:
        workload, played, steps, readings = run
    from_trace = calibrate(steps, workload, source="the server's trace")
    from_metrics = calibrate_metrics(readings, source="the server's /metrics")
    trace_error = time_error(from_trace.model, steps, workload)
    metrics_error = time_error(from_metrics.model, steps, workload)
    report = [
        f"trace fit:   {from_trace.model.describe()}",
        f"metrics fit: {from_metrics.model.describe()}",
        *from_metrics.describe().splitlines()[1:],
        f"time error on the run's {len(steps)} steps: trace fit {trace_error:+.1%}, "
        f"metrics fit {metrics_error:+.1%}",
    ]
    # What a planner gets from each: every user's tok/s simulated with the
    # metrics fit is judged against the engine's (METRICS_BOUND); first
    # tokens are printed (docs/simulate.md: fit a trace for those).
    runs = {
        name: sim(workload, m.model, sim_server.policy_path)
        for name, m in (("trace", from_trace), ("metrics", from_metrics))
    }
    failures = []
    for user in runs["trace"].users:
        real = engine_rate(user_tokens(steps, user))
        rates = ", ".join(f"{n} {r.users[user].rate:.1f}" for n, r in runs.items())
        ttfts = ", ".join(f"{n} {(r.users[user].ttft_p50 or 0) / 1e6:.1f}" for n, r in runs.items())
        report.append(
            f"{user}: engine {real:.1f} tok/s, simulated with the {rates}; TTFT p50 engine "
            f"{engine_ttft_p50(played, user) * 1000:.1f} ms, simulated with the {ttfts}"
        )
        if abs(runs["metrics"].users[user].rate - real) > METRICS_BOUND * real:
            failures.append(f"{user}: tok/s with the metrics fit")
    print("\n".join(report))
    assert abs(metrics_error) <= METRICS_BOUND, "\n".join(report)
    assert not failures, "\n".join([*failures, *report])


def test_a_throttled_hog_and_a_normal_user_as_the_engine_shows_them(sim_server):
    model = getattr(sim_server, "step_model", None)
    if model is None:  # run alone: calibrate on the agreement workload first
        workload, _, steps = play(sim_server, "e2e-agree.yaml")
        model = calibrate(steps, workload).model
    workload, played, steps = play(sim_server, "e2e-hog.yaml")
    result = sim(workload, model, sim_server.policy_path)
    real_ttft = engine_ttft_p50(played, "dave")
    sim_ttft = (result.users["dave"].ttft_p50 or 0) / 1e9
    hog_real = engine_rate(user_tokens(steps, "hog"))
    dave_done = sum(1 for p in played if p.user == "dave" and p.finish_reason == "length")
    report = (
        f"dave TTFT p50: engine {real_ttft * 1000:.1f} ms, simulated {sim_ttft * 1000:.1f} ms; "
        f"dave requests engine {dave_done}, simulated {result.users['dave'].completed}; hog "
        f"engine {hog_real:.1f} tok/s, simulated {result.users['hog'].rate:.1f}, held "
        f"{result.users['hog'].held_share:.0%}, deferred {result.users['hog'].deferred}"
    )
    print(report)
    assert ttft_agrees(real_ttft, sim_ttft), report
    # The hog is throttled in both (held, its admissions deferred), and dave
    # got through in both.
    hog = result.users["hog"]
    assert hog.held_share > 0.2 and hog.deferred > 0, report
    assert abs(hog.rate - 20) < 2 and abs(hog_real - 20) < 2, report
    assert abs(result.users["dave"].completed - dave_done) <= max(2, 0.2 * dave_done), report


def test_a_borrowing_user_as_the_engine_shows_it(sim_server):
    """Work-conserving limits (issue 33): `lender` {rate: 20, peak: unlimited}
    with more streams than active slots, beside dave. The simulator runs the
    scheduler's lending as the engine does: the same bounds as the agreement
    test (tok/s within 5%, TTFT p50 within 25% or 20 ms)."""
    model = getattr(sim_server, "step_model", None)
    if model is None:  # run alone: calibrate on the agreement workload first
        workload, _, steps = play(sim_server, "e2e-agree.yaml")
        model = calibrate(steps, workload).model
    # The lender's rate is the engine's: it follows the step length one for
    # one. The lending is judged with the model scaled to the step length
    # this run measured, which takes out the step model's error on a
    # workload it was not fitted on (test_simulate_oos's to judge) and any
    # move of the machine since the calibration, and with the run's own
    # client turnaround, which dave's tok/s follows (sim_drift.at_measured).
    workload, played, steps = play(sim_server, "e2e-lend.yaml")
    measured, drift = at_measured(model, steps, workload)
    raw = sim(workload, model, sim_server.policy_path)
    result = sim(workload, measured, sim_server.policy_path)
    borrowed = sum(r.get("borrowed", {}).get("lender", 0) for r in steps)
    report = [f"step length off the model by {drift:+.1%} on the run (scaled to it)"]
    failures = []
    for user in ("lender", "dave"):
        real_rate = engine_rate(user_tokens(steps, user))
        real_ttft = engine_ttft_p50(played, user)
        stats = result.users[user]
        sim_ttft = (stats.ttft_p50 or 0) / 1e9
        report.append(
            f"{user}: engine {real_rate:.1f} tok/s, simulated {stats.rate:.1f} "
            f"({(stats.rate - real_rate) / real_rate:+.1%}; raw model "
            f"{raw.users[user].rate:.1f}); TTFT p50 engine {real_ttft * 1000:.1f} ms, "
            f"simulated {sim_ttft * 1000:.1f} ms"
        )
        if abs(stats.rate - real_rate) > RATE_BOUND * real_rate:
            failures.append(f"{user}: rate")
        # The lender's own first tokens wait for a slot behind its other
        # streams: the queueing that docs/simulate.md ("Out of sample") finds
        # the simulator gets in order of magnitude, not in p50 (issue 36,
        # open). Printed, not judged; dave's, which waits for nobody, is.
        if user != "lender" and not ttft_agrees(real_ttft, sim_ttft):
            failures.append(f"{user}: TTFT")
    report.append(f"the engine's trace: {borrowed} of the lender's tokens borrowed")
    print("\n".join(report))
    assert borrowed > 0.5 * sum(r.get("charged", {}).get("lender", 0) for r in steps)
    assert not failures, "\n".join([*failures, *report])


FLOOD_S = 10
"""The part of examples/workloads/prompt-flood.yaml played (of its 30 s)."""
FLOOD_STREAMS = 2
"""mallory's streams in the played flood (8 in the file): a prompt waiting
for her budget has no response to cut at the end of the play, so the play
lasts until every one in flight got its first token, ~1,900 x streams / 500
s past the end (30 s more with 8)."""


def test_a_prompt_flood_as_the_engine_shows_it(sim_server):
    """Issue 40's prompt flood (examples/workloads/prompt-flood.yaml, its
    first FLOOD_S with FLOOD_STREAMS of mallory's) under
    examples/workloads/prompt-flood-policy.yaml (mallory `{rate: 20, prompt:
    500}`, bob 100), given to the server by hot reload: mallory's computed
    prompt tokens per second (the trace's `prompt`) over the workload's
    seconds and bob's tok/s, engine and simulated, within the agreement
    test's bound; simulated with the calibrated model at the step length
    and client turnaround the run measured, as the lending case (the
    model's error on a workload it was not fitted on is test_simulate_oos's
    to judge); bob's
    time to first token p50 too (measured 2026-12-04: mallory 500.9 and
    505.0 prompt tok/s, bob 101.1 and 101.1 tok/s, 3.0 and 3.8 ms)."""
    model = getattr(sim_server, "step_model", None)
    if model is None:  # run alone: calibrate on the agreement workload first
        workload, _, steps = play(sim_server, "e2e-agree.yaml")
        model = calibrate(steps, workload).model
    policy = WORKLOADS / "prompt-flood-policy.yaml"
    flood = load_workload(WORKLOADS / "prompt-flood.yaml").workload
    users = dict(flood.users)
    users["mallory"] = users["mallory"].model_copy(update={"streams": FLOOD_STREAMS})
    flood = flood.model_copy(update={"users": users, "duration": FLOOD_S * 1_000_000_000})
    before = sim_server.policy_path.read_text()
    use_policy(sim_server, policy.read_text())
    try:
        wait_idle(sim_server)
        since = time.monotonic_ns()
        played = Player(sim_server.base_url, flood).play()
        time.sleep(0.5)  # the trace is written every 100 ms
        steps = [r for r in read_trace(sim_server.trace_path) if "step" in r and r["t"] >= since]
    finally:
        use_policy(sim_server, before)
    assert all(p.error is None for p in played), [p.error for p in played if p.error][:3]
    measured, drift = at_measured(model, steps, flood)
    result = sim(flood, measured, policy)
    end = since + FLOOD_S * 1_000_000_000
    mallory = sum(r.get("prompt", {}).get("mallory", 0) for r in steps if r["t"] < end) / FLOOD_S
    bob = engine_rate(user_tokens(steps, "bob", until_ns=end))
    got = {"mallory": (mallory, result.users["mallory"].prompt_rate)}
    got["bob"] = (bob, result.users["bob"].rate)
    ttft = (engine_ttft_p50(played, "bob"), (result.users["bob"].ttft_p50 or 0) / 1e9)
    report = [f"step length off the model by {drift:+.1%} on the run (scaled to it)"]
    units = ("prompt tok/s", "tok/s")
    report += [
        f"{user}: engine {real:.1f} {unit}, simulated {simulated:.1f} "
        f"({(simulated - real) / real:+.1%})"
        for (user, (real, simulated)), unit in zip(got.items(), units, strict=True)
    ]
    report.append(
        f"bob's TTFT p50: engine {ttft[0] * 1000:.1f} ms, simulated {ttft[1] * 1000:.1f} ms"
    )
    print("\n".join(report))
    assert mallory > 400  # she flooded, at her prompt rate
    failures = [u for u, (real, s) in got.items() if abs(s - real) > RATE_BOUND * real]
    if not ttft_agrees(*ttft):
        failures.append("bob: TTFT")
    assert not failures, "\n".join([*failures, *report])
