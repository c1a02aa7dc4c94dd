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
  steps, with how the machine moved taken out (sim_drift: a probe of the
  calibration workload right after the case, its decode steps against the
  calibration run's, no model asked), within CARRY_BOUND. A case out by
  more (up to ~30% today, CARRY_REASON) is an expected failure with its
  figures; one within the bound passes. A probe that cannot tell the
  machine (no batch size in common) has the case and its probe played
  once more; still not, it fails under CI, skips elsewhere. A probe that
  reads the machine moved is not a reason to play again: the machine's
  play-to-play noise is larger than the bound (benchmarks/carry_over.py
  over ten quiet runs' traces: the probes of one run spread 8-82%, median
  25%; the model's error per case, the probe's reading taken out, mean
  -2% to +3%, sd 14-17%), and a case played again because its probe
  moved past 10% came out no nearer: 4 nearer, 7 further, in those runs;
- the scheduling agrees: the case simulated with the model scaled to the
  step length the case measured (so the model's error, judged above, does
  not count twice, and neither does any move of the machine), every
  user's tok/s and time to first token within the bounds. KNOWN lists the
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
    PROBE_S,
    at_measured_length,
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
from outrate.simulate.stepmodel import (  # noqa: E402
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
CARRY_BOUND = 0.10
"""The step model's step-length error on a workload it was not fitted on."""
CARRY_REASON = (
    "the step model fitted on e2e-agree.yaml and e2e-idle.yaml misjudges the step "
    "length of a workload it never saw by up to ~10-30% (quiet runs here, "
    "2026-12-04: oos-hog -10.4%, -3.7%, +3.6%, -25.2%, -9.6%, -9.2%; oos-interactive "
    "+13.3%, -9.5%, +31.7%, -0.7%, +15.9%, -10.9%; oos-mix -11.0%, -10.3%, -0.9%, "
    "+4.1%, +11.1%, -7.9%; all three within 10% in another run), against -21% to "
    "-33% before "
    "the wake cost after an idle "
    "step; that cost grows with the idle's length (+0.1-0.4 ms after 1-4 ms, "
    "~1.9 ms after 16-32 ms) and the model charges it flat, which over-charges "
    "oos-interactive's short waits (docs/simulate.md, Out of sample; issue 40)"
)

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
    machine: float
    """How the machine moved since the calibration: the probe played right
    after, its decode steps against the calibration's (sim_drift)."""
    tries: int

    def describe(self, case: str) -> str:
        return (
            f"{case}: step length off the model by {self.run_error:+.1%} on the case; the "
            f"machine's decode steps {self.machine:+.1%} against the calibration's (the probe), "
            f"so the model's own error {model_error(self.run_error, self.machine):+.1%}; "
            f"played {self.tries}x"
        )


@pytest.fixture(scope="module")
def calibration_run(sim_server) -> tuple[Calibration, dict[int, list[float]]]:
    """The step model fitted on 15 s of the calibration workload and 6 s of
    its throttled user alone (e2e-idle.yaml: the engine waits between its
    tokens, so the fit sees the steps after a wait, which the busy 15 s
    have almost none of), and the 15 s run's decode-only step lengths (what
    each probe is held against)."""
    workload, _, busy = play(sim_server, "e2e-agree", seconds=15)
    _, _, idle = play(sim_server, "e2e-idle")
    cal = calibrate(
        busy + idle, workload, source="15 s of e2e-agree.yaml and e2e-idle.yaml on the trace"
    )
    print(cal.describe())
    return cal, decode_step_us(busy, workload)


@pytest.fixture(scope="module")
def calibrated(calibration_run) -> Calibration:
    return calibration_run[0]


@pytest.fixture(scope="module")
def runs(sim_server, calibration_run) -> dict[str, CaseRun]:
    """Each case played once (lazily, by the first test that asks), with its
    probe; played again once if the probe cannot tell the machine (the
    second run is kept either way)."""

    class Runs(dict):
        def __missing__(self, case: str) -> CaseRun:
            def once(tries: int) -> CaseRun:
                workload, played, steps = play(sim_server, case)
                probe, _, probe_steps = play(sim_server, "e2e-agree", seconds=PROBE_S)
                return CaseRun(
                    workload,
                    played,
                    steps,
                    time_error(calibration_run[0].model, steps, workload),
                    machine_drift(calibration_run[1], decode_step_us(probe_steps, probe)),
                    tries,
                )

            def blind(run: CaseRun) -> str | None:
                if told(run.machine):
                    return None
                return f"{case}: the probe could not tell the machine"

            run = self[case] = replay_once(once, blind)
            return run

    return Runs()


@pytest.mark.parametrize("case", CASES)
def test_the_step_model_carries_over_to_a_workload_it_never_saw(calibrated, runs, case):
    run = runs[case]
    print(calibrated.describe())
    print(run.describe(case))
    if not told(run.machine):
        unjudgeable(f"the probe could not tell the machine: {run.describe(case)}")
    error = model_error(run.run_error, run.machine)
    if abs(error) <= CARRY_BOUND:
        return
    pytest.xfail(f"{run.describe(case)}: over {CARRY_BOUND:.0%}; {CARRY_REASON}")


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
        real_rate = engine_rate(user_tokens(run.steps, user))
        real_ttft = statistics.median(ttfts.get(user, [0.0]))
        sim_ttft = (stats.ttft_p50 or 0) / 1e9
        rate_ok = abs(stats.rate - real_rate) <= RATE_BOUND * real_rate
        ttft_ok = abs(real_ttft - sim_ttft) <= max(TTFT_BOUND * real_ttft, TTFT_SLACK_S)
        r = raw.users[user]
        report.append(
            f"{case} {user}: tok/s engine {real_rate:.1f}, simulated {stats.rate:.1f} "
            f"({(stats.rate - real_rate) / real_rate:+.0%}); TTFT p50 engine "
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
