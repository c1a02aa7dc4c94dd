"""Out of sample (issue 36): the simulator calibrated on one workload,
asked about three others it never saw, against a real `outrate serve`.

One server (the tiny model, `--max-num-seqs 12 --max-num-active-seqs 8`,
examples/workloads/oos-policy.yaml). The step model is fitted on
e2e-agree.yaml and e2e-idle.yaml (busy steps, and steps after the engine
waited), as docs/simulate.md tells an operator to; then oos-hog.yaml
(a capped hog with 4x --max-num-seqs streams beside an open-loop user),
oos-interactive.yaml (users with think time; a tier with max_streams) and
oos-mix.yaml (all of it at once) are played on the server and simulated
with that model.

Bounds per user: tok/s within 10%; time to first token p50 within 30% or
50 ms. Both sides count the same requests: every request that got a first
token, those cut at the workload's end included. Engine side: tok/s from
the engine's trace; time to first token from vLLM's per-request metrics
(queue + first token, engine-core timestamps), which arrive only with a
finished request: for a request cut after its first token, the client's
time to first token less this run's median API-server delay (client minus
engine, over the finished requests; about 20 ms here).

Two kinds of check, each case its own test:
- the step model carries over: its step-length error on the case's own
  steps, with how the machine moved taken out (sim_drift: the calibration
  workload played for PROBE_S before the case and after it, their decode
  steps against the calibration run's, no model asked: `bracket`), within
  PLAY_BOUND. That bound is loose on purpose: on this machine the same
  decode step's median moves 10-40% between 2.5 s windows of one play in
  some runs, and a play's figure with the best correction found still
  spreads by an sd of 9-12% a case, so a single play can judge only a
  model that is badly wrong (without the wake cost: up to -47%). Whether
  the model carries over within 10% is the mean over many plays, judged
  by benchmarks/carry_over.py on the traces this module leaves (every
  `make test` leaves one) or on runs of its own (`--play N`):
  docs/simulate.md, "Out of sample". A probe pair that cannot tell the
  machine (no batch size in common) has the case and its probe played
  once more; still not, it fails under CI, skips elsewhere. A probe that
  reads the machine moved is not a reason to play again: a case played
  again because its probe moved past 10% came out no nearer (4 nearer,
  7 further, over ten quiet runs);
- the scheduling agrees: the case simulated with the model scaled to the
  step length the case measured (so the model's error, judged above, does
  not count twice, and neither does any move of the machine), every
  user's tok/s and time to first token within the bounds. A user's tok/s
  is judged at the length of the steps it decoded in: the machine moves
  within a play too, and a user no limit holds (oos-interactive's reader)
  runs at the speed of its own stretch of it: at the case's length the
  reader read -1.9% to +9.0% on 39 quiet traces here and +10.1% on CI; at
  its own, -2.5% to +2.0% on the same traces (benchmarks/carry_over.py
  --rates). KNOWN lists the
  checks that fail today, each with its reason and figures
  (docs/simulate.md, "Out of sample"): they are printed, not asserted, and
  the list is the work left.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import sim_servers  # noqa: E402
from serverproc import replay_once  # noqa: E402
from sim_drift import (
    CALIBRATION_S,
    PROBE_S,
    at_measured_length,
    at_own_length,
    bracket,
    last,
    machine_drift,
    model_error,
    told,
    unjudgeable,
)
from sim_drift import (  # noqa: E402
    play as play_file,
)
from sim_servers import SimServer  # noqa: E402
from workload_player import Played  # noqa: E402

from outrate.observe.trace import engine_rate, user_tokens  # noqa: E402
from outrate.simulate.engine import engine_from_flags  # noqa: E402
from outrate.simulate.tracefit import (  # noqa: E402
    Calibration,
    calibrate,
    decode_step_us,
    time_error,
)
from vllm_integration.offline.simulator import simulate  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.quiet]

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "examples" / "workloads"
POLICY = WORKLOADS / "oos-policy.yaml"
ENGINE_FLAGS = ["--max-num-seqs", "12", "--max-num-active-seqs", "8"]
KV_TOKENS = 256 * 1024 * 1024 // 512  # --kv-cache-memory-bytes 256M at 512 bytes a token
RATE_BOUND = 0.10
TTFT_BOUND, TTFT_SLACK_S = 0.30, 0.050
CASES = ("oos-hog", "oos-interactive", "oos-mix")
PLAY_BOUND = 0.35
"""The step model's step-length error on one play of a workload it was not
fitted on, the machine's move taken out: over 126 plays (42 runs,
2026-12-04 to 12-06) two were past it, -39.6% and +56.3%, both where the
machine moved faster than the probes could follow (docs/simulate.md,
"One play, a loose bound"); the next largest 33.1%. The model without
its wake cost is past it in 20 of those 42 runs (24 plays, up to 47.6%).
The 10% target is judged on the mean over plays
(benchmarks/carry_over.py)."""

_SLOTS = (
    "its requests queue for a slot (max_streams, or --max-num-seqs full of held "
    "requests): its time to first token is two-humped (a slot free soon, or "
    "waiting ~4.5 s for a request to finish), and the p50 of ~10 requests "
    "lands between the humps differently from one engine run to the next"
)
KNOWN: dict[tuple[str, str, str], str] = {
    # The engine's figures over the runs on this machine and the simulator's;
    # docs/simulate.md, "Out of sample".
    ("oos-hog", "hog", "ttft"): (
        "10-12 of 48 requests get a slot during the 1 s ramp, each waiting for "
        "the hog's budget: engine 38-359 ms over ten runs (it does not repeat "
        "itself); simulated 27-156 ms"
    ),
    **{
        ("oos-interactive", f"member-{i}", "ttft"): _SLOTS
        + ". The fast hump is the time between the ends of the member's two "
        "running requests: their split of its 25 tok/s. On the engine a long "
        "step (another user's prompt) sometimes lets the budget refill before "
        "the member's running request is refused, and the request released in "
        "that step loses its turn to it (1-2 such steps per member a run in "
        "the engine's trace, none simulated, where steps of one batch are all "
        "one length); each moves the split by a token. Engine 88-1149 ms over "
        "ten runs x 3 members, simulated 35-176 ms"
        for i in (1, 2, 3)
    },
    ("oos-mix", "chat", "ttft"): (
        _SLOTS + "; since fair admission picks by user, engine 200, 360, 368 and "
        "507 ms in four runs, simulated 254-495 ms (one run outside: 360 against 495)"
    ),
    ("oos-mix", "hog", "ttft"): (
        _SLOTS + "; engine 100-5531 ms over six runs, simulated 3617-5887 ms: "
        "which hump the median lands in moves from run to run"
    ),
}


SIM_SERVER = SimServer(tuple(ENGINE_FLAGS), POLICY)
"""Started with test_simulate_e2e's before any test (tests/sim_servers.py)."""


@pytest.fixture(scope="module")
def sim_server(request):
    return sim_servers.sim_server(request)


def play(sim_server, name: str, seconds: int = 0) -> tuple[object, list[Played], list[dict]]:
    """Play a workload of examples/workloads (sim_drift.play)."""
    return play_file(sim_server, WORKLOADS / f"{name}.yaml", seconds)


def engine_ttfts(played: list[Played]) -> dict[str, list[float]]:
    """Per user, the engine-side time to first token of every request that
    got one (see the module's docstring for the cut ones)."""
    finished = [p for p in played if p.engine_ttft_s is not None and p.first is not None]
    assert finished, "no per-request metrics: is --enable-per-request-metrics on?"
    delay = statistics.median(p.client_ttft_s - p.engine_ttft_s for p in finished)
    out: dict[str, list[float]] = {}
    for p in played:
        if p.first is None:
            continue
        ttft = p.engine_ttft_s if p.engine_ttft_s is not None else p.client_ttft_s - delay
        out.setdefault(p.user, []).append(ttft)
    return out


@dataclass
class CaseRun:
    workload: object
    played: list[Played]
    steps: list[dict]
    run_error: float
    """The model's step-length error on the case's own steps."""
    before: float
    after: float
    """How the machine moved since the calibration, read by the probe played
    before the case and by the one after: their decode steps against the
    calibration's (sim_drift.machine_drift)."""
    tries: int

    @property
    def machine(self) -> float:
        return bracket(self.before, self.after)

    def describe(self, case: str) -> str:
        return (
            f"{case}: step length off the model by {self.run_error:+.1%} on the case; the "
            f"machine's decode steps {self.machine:+.1%} against the calibration's (the probes "
            f"before and after: {self.before:+.1%}, {self.after:+.1%}), so the model's own "
            f"error {model_error(self.run_error, self.machine):+.1%}; played {self.tries}x"
        )


@pytest.fixture(scope="module")
def calibration_run(sim_server) -> tuple[Calibration, dict[int, list[float]], float]:
    """The step model fitted on 15 s of the calibration workload and 7 s of
    throttled users alone in turn (e2e-idle.yaml: the engine waits ~30,
    ~10 and ~2 ms between their tokens, so the fit sees the steps after a
    wait, which the busy 15 s have almost none of, and how their cost grows
    with the wait); the 15 s run's decode-only step lengths (what
    each probe is held against); and its last PROBE_S seconds read as a
    probe (the first case's probe before)."""
    workload, _, busy = play(sim_server, "e2e-agree", seconds=CALIBRATION_S)
    _, _, idle = play(sim_server, "e2e-idle")
    cal = calibrate(
        busy + idle, workload, source="15 s of e2e-agree.yaml and e2e-idle.yaml on the trace"
    )
    print(cal.describe())
    reference = decode_step_us(busy, workload)
    return cal, reference, machine_drift(reference, decode_step_us(last(busy), workload))


@pytest.fixture(scope="module")
def calibrated(calibration_run) -> Calibration:
    return calibration_run[0]


@pytest.fixture(scope="module")
def runs(sim_server, calibration_run) -> dict[str, CaseRun]:
    """Each case played once (lazily, by the first test that asks), then its
    probe; the probe before it is the previous case's (the first case's: the
    calibration's end). Played again once if neither probe can tell the
    machine (the second run is kept either way)."""
    cal, reference, calibration_end = calibration_run

    class Runs(dict):
        before = calibration_end

        def __missing__(self, case: str) -> CaseRun:
            def once(tries: int) -> CaseRun:
                workload, played, steps = play(sim_server, case)
                probe, _, probe_steps = play(sim_server, "e2e-agree", seconds=PROBE_S)
                after = machine_drift(reference, decode_step_us(probe_steps, probe))
                run = CaseRun(
                    workload,
                    played,
                    steps,
                    time_error(cal.model, steps, workload),
                    self.before,
                    after,
                    tries,
                )
                self.before = after
                return run

            def blind(run: CaseRun) -> str | None:
                if told(run.machine):
                    return None
                return f"{case}: the probes could not tell the machine"

            run = self[case] = replay_once(once, blind)
            return run

    return Runs()


@pytest.mark.parametrize("case", CASES)
def test_the_step_model_carries_over_to_a_workload_it_never_saw(calibrated, runs, case):
    run = runs[case]
    print(calibrated.describe())
    print(run.describe(case))
    if not told(run.machine):
        unjudgeable(f"the probes could not tell the machine: {run.describe(case)}")
    error = model_error(run.run_error, run.machine)
    assert abs(error) <= PLAY_BOUND, f"{run.describe(case)}: over {PLAY_BOUND:.0%}"


@pytest.mark.parametrize("case", CASES)
def test_the_simulator_schedules_a_workload_it_never_saw_as_the_engine_does(
    sim_server, calibrated, runs, case
):
    run = runs[case]
    engine = engine_from_flags(ENGINE_FLAGS, kv_cache_tokens=KV_TOKENS)
    raw = simulate(run.workload, engine, str(POLICY), calibrated.model)
    scaled = at_measured_length(calibrated.model, run.run_error)
    result = simulate(run.workload, engine, str(POLICY), scaled)
    ttfts = engine_ttfts(run.played)
    report = [run.describe(case)]
    failures, known = [], []
    for user, stats in result.users.items():
        # Its tok/s at the length of the steps it decoded in (sim_drift).
        mine, own = at_own_length(calibrated.model, run.steps, run.workload, user)
        sim_rate = simulate(run.workload, engine, str(POLICY), mine).users[user].rate
        real_rate = engine_rate(user_tokens(run.steps, user))
        real_ttft = statistics.median(ttfts.get(user, [0.0]))
        sim_ttft = (stats.ttft_p50 or 0) / 1e9
        rate_ok = abs(sim_rate - real_rate) <= RATE_BOUND * real_rate
        ttft_ok = abs(real_ttft - sim_ttft) <= max(TTFT_BOUND * real_ttft, TTFT_SLACK_S)
        r = raw.users[user]
        report.append(
            f"{case} {user}: tok/s engine {real_rate:.1f}, simulated {sim_rate:.1f} "
            f"({(sim_rate - real_rate) / real_rate:+.0%}; at the case's step length "
            f"{stats.rate:.1f}, its own steps off the model by {own:+.1%}); TTFT p50 engine "
            f"{real_ttft * 1000:.0f} ms, simulated {sim_ttft * 1000:.0f} ms; first tokens "
            f"engine {len(ttfts.get(user, []))}, simulated {stats.started} (with the "
            f"model's own step length: {r.rate:.1f} tok/s, TTFT p50 "
            f"{(r.ttft_p50 or 0) / 1e6:.0f} ms)"
        )
        for check, ok in (("rate", rate_ok), ("ttft", ttft_ok)):
            reason = KNOWN.get((case, user, check))
            if reason is not None:
                known.append(f"{case} {user} {check} ({'within' if ok else 'outside'}): {reason}")
            elif not ok:
                failures.append(f"{case} {user}: {check}")
    print("\n".join([*report, "known divergences:", *known]))
    assert not failures, "\n".join([*failures, *report])
