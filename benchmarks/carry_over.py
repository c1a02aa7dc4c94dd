"""The step model's carry-over, over many runs: tests/test_simulate_oos.py's
judge replayed on the traces its server left (docs/simulate.md, "Out of
sample"; issue 40, item 8).

    python benchmarks/carry_over.py [TRACE.jsonl ...]
    python benchmarks/carry_over.py --play N [--out DIR] [--cases A,B,...]
    python benchmarks/carry_over.py --rates [TRACE.jsonl ...]

With no argument it reads every `/tmp/outrate-quiet-*/test_simulate_oos/
trace.jsonl` (each `make test` leaves one: tests/sim_servers.py). With
`--play N` it starts the module's server (the tiny model, the same flags
and policy) and plays the module's sequence N times, one trace per run
under DIR, then judges those (`--cases`: other cases in its place, e.g.
oos-prefix.yaml, which the test does not play, three times:
`--cases oos-prefix,oos-prefix,oos-prefix`). A trace holds the plays of one run back to
back, each after the engine went idle: the 3 s warm-up, the 15 s
calibration (e2e-agree.yaml), e2e-idle.yaml, then each case (oos-hog,
oos-interactive, oos-mix: 20 s) followed by its 5 s probe (e2e-agree.yaml
again), a case played twice where the test replayed it. The plays are told
apart by the idle gaps between them and by the users each step charged.

For every case play it computes what the test does, with the step model of
this checkout (tests/sim_drift.py, outrate/simulate/tracefit.py): the
model fitted on the calibration and e2e-idle, its error on the case's steps
(`raw`), the probes' decode-only steps against the calibration's, before
the case (the previous probe; for the first case, the calibration's last
5 s) and after it (the machine, no model asked), and the model's own
error, the machine's move (their mean) taken out (`model`). Then per
case, over all runs: the mean of `model` with its 95% interval, its
spread, and how many single plays are within 10%. The target is on the
mean: a single play on this machine moves with it (the probes of one run,
the same 5 s of the same workload minutes apart, read against one
calibration: printed per run). Exits 1 where a case's mean is past 10%.

`--rates` replays the test's other check instead, on the same traces:
each user's tok/s simulated with the model scaled to the case's step
length and to the length of the steps that user decoded in (the one the
test judges), against the engine's; then each user's largest error both
ways over the traces.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "examples")]

from sim_drift import CALIBRATION_S, bracket, last, machine_drift, model_error  # noqa: E402

from outrate.observe.trace import read_trace  # noqa: E402
from outrate.simulate.stepmodel import StepModel  # noqa: E402
from outrate.simulate.tracefit import calibrate, decode_step_us, time_error  # noqa: E402
from outrate.simulate.workload import Workload, load_workload  # noqa: E402

WORKLOADS = REPO / "examples" / "workloads"
CASES = ("oos-hog", "oos-interactive", "oos-mix")
"""What tests/test_simulate_oos.py plays, and `--play` by default."""
OTHERS = ("oos-prefix",)
"""Cases the test does not play, for `--play N --cases ...`."""
DEFAULT_GLOB = "/tmp/outrate-quiet-*/test_simulate_oos/trace.jsonl"
GAP_NS = 450_000_000
"""Between two plays the engine idles at least this long (the test waits
for it to be idle, then 0.5 s, then starts the next); within a play no
step waits that long here."""
BOUND = 0.10
Line = dict[str, Any]


def plays(lines: list[Line]) -> list[list[Line]]:
    """A trace's steps cut at the idle gaps between plays."""
    steps = [r for r in lines if "step" in r and "t" in r]
    out: list[list[Line]] = []
    for r in steps:
        if out and r["t"] - out[-1][-1]["t"] <= GAP_NS:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def case_of(play: list[Line]) -> str | None:
    """Which case a play is, by the users it charged (None: not a case)."""
    users = {u.split("-")[0] for r in play for u in r.get("charged", {})}
    if "single" in users:
        return "oos-prefix"
    if "member" in users:
        return "oos-mix" if "hog" in users else "oos-interactive"
    return "oos-hog" if "hog" in users else None


Case = tuple[str, list[Line], StepModel, float, float]


def cases(lines: list[Line], w: dict[str, Workload]) -> list[Case]:
    """(case, its steps, the step model fitted on the run's calibration, probe
    before, probe after) for each case play of one trace."""
    cut = plays(lines)
    first = next((i for i, p in enumerate(cut) if case_of(p)), len(cut))
    if first < 2 or len(cut) < first + 2:
        raise ValueError(f"not a run of test_simulate_oos: {len(cut)} plays")
    # The calibration and e2e-idle are the two plays before the first case;
    # what comes before them is the warm-up, in as many pieces as its idle
    # gaps cut it (a make test run: two). With none before (the module run
    # alone: no idle gap between warm-up and calibration), the calibration
    # is the last 15 s of both.
    cal, idle, rest = cut[first - 2], cut[first - 1], cut[first:]
    if first == 2:
        cal = last(cal, CALIBRATION_S)
    model = calibrate(cal + idle, w["e2e-agree"]).model
    reference = decode_step_us(cal, w["e2e-agree"])
    before = machine_drift(reference, decode_step_us(last(cal), w["e2e-agree"]))
    out = []
    for case_play, probe in zip(rest[0::2], rest[1::2], strict=False):
        case = case_of(case_play)
        if case is None or case_of(probe) is not None:
            break
        after = machine_drift(reference, decode_step_us(probe, w["e2e-agree"]))
        out.append((case, case_play, model, before, after))
        before = after
    return out


def judge(lines: list[Line], w: dict[str, Workload]) -> list[tuple[str, float, float, float]]:
    """(case, raw error, probe before, probe after) for each case play of one
    trace, as tests/test_simulate_oos.py computes them."""
    return [(c, time_error(m, p, w[c]), b, a) for c, p, m, b, a in cases(lines, w)]


def rates(paths: list[str], w: dict[str, Workload]) -> None:
    """test_simulate_oos' second check on each trace: every user's tok/s
    simulated at the case's step length and at its own steps' (the one
    judged), against the engine's; then, per case and user, the largest
    error of each over the traces."""
    from sim_drift import at_measured_length, at_own_length
    from test_simulate_oos import ENGINE_FLAGS, KV_TOKENS, POLICY

    from outrate.observe.trace import engine_rate, user_tokens
    from outrate.simulate.engine import engine_from_flags
    from vllm_integration.offline.simulator import simulate

    engine = engine_from_flags(ENGINE_FLAGS, kv_cache_tokens=KV_TOKENS)
    worst: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        print(path)
        for case, steps, model, _, _ in cases(list(read_trace(path)), w):
            whole = time_error(model, steps, w[case])
            at_case = simulate(w[case], engine, str(POLICY), at_measured_length(model, whole))
            for user, stats in sorted(at_case.users.items()):
                real = engine_rate(user_tokens(steps, user))
                mine, own_error = at_own_length(model, steps, w[case], user)
                own = simulate(w[case], engine, str(POLICY), mine)
                errors = [(x - real) / real for x in (stats.rate, own.users[user].rate)]
                print(
                    f"  {case:16s} {user:9s} engine {real:6.1f} tok/s; simulated at the "
                    f"case's length {errors[0]:+6.1%}, at its own steps' ({own_error:+.1%}) "
                    f"{errors[1]:+6.1%}"
                )
                top = worst.setdefault((case, user), [0.0, 0.0])
                worst[(case, user)] = [max(a, abs(b)) for a, b in zip(top, errors, strict=True)]
    print()
    for (case, user), (a, b) in sorted(worst.items()):
        print(
            f"{case:16s} {user:9s} largest |error|: at the case's length {a:.1%}, its own {b:.1%}"
        )


def _within(xs: list[float]) -> str:
    return f"{sum(abs(x) <= BOUND for x in xs)} of {len(xs)} plays within {BOUND:.0%}"


def play_runs(n: int, out: Path, cases: tuple[str, ...] = CASES) -> list[str]:
    """The module's sequence played `n` times on one server of its own
    (tests/sim_servers.py's, as the module has it); one trace per run under
    `out`."""
    from e2e_support import start_together
    from sim_drift import PROBE_S, play
    from sim_servers import server_in
    from test_simulate_oos import SIM_SERVER

    out.mkdir(parents=True, exist_ok=True)
    server = server_in(out, SIM_SERVER)
    start_together([server], timeout_s=300)
    paths = []
    try:
        for run in range(n):
            steps = []
            for name, seconds in (("e2e-agree", 3), ("e2e-agree", CALIBRATION_S), ("e2e-idle", 0)):
                steps += play(server, WORKLOADS / f"{name}.yaml", seconds)[2]
            for case in cases:
                steps += play(server, WORKLOADS / f"{case}.yaml")[2]
                steps += play(server, WORKLOADS / "e2e-agree.yaml", PROBE_S)[2]
            path = out / f"run-{run + 1}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in steps))
            paths.append(str(path))
            print(f"played run {run + 1} of {n}: {path}", flush=True)
    finally:
        server.stop()
    return paths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--play", type=int, default=0, metavar="N")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR")
    parser.add_argument("--cases", default=",".join(CASES), help="what --play plays, in order")
    parser.add_argument("--rates", action="store_true", help="each user's tok/s, simulated")
    args = parser.parse_args(argv)
    paths = args.traces
    if args.play:
        cases = tuple(args.cases.split(","))
        unknown = set(cases) - {*CASES, *OTHERS}
        if unknown:
            parser.error(
                f"--cases: unknown {sorted(unknown)[0]!r} (known: {', '.join((*CASES, *OTHERS))})"
            )
        out = args.out or Path(tempfile.mkdtemp(prefix="carry-over-"))
        paths += play_runs(args.play, out, cases)
    paths = paths or sorted(glob.glob(DEFAULT_GLOB))
    if not paths:
        print(f"no traces: give TRACE.jsonl files, or run make test first ({DEFAULT_GLOB})")
        return 1
    known = ("e2e-agree", *CASES, *OTHERS)
    w = {n: load_workload(WORKLOADS / f"{n}.yaml").workload for n in known}
    if args.rates:
        rates(paths, w)
        return 0
    found: dict[str, list[float]] = {c: [] for c in (*CASES, *OTHERS)}
    noise = []
    for path in paths:
        try:
            judged = judge(list(read_trace(path)), w)
        except ValueError as e:
            print(f"{path}: skipped, {e}")
            continue
        if not judged:
            print(f"{path}: skipped, no case was played (a run cut short)")
            continue
        probes = [a for *_, a in judged]
        noise.append(max(probes) - min(probes))
        print(path)
        for case, raw, before, after in judged:
            error = model_error(raw, bracket(before, after))
            if not math.isnan(error):
                found[case].append(error)
            print(
                f"  {case:16s} raw {raw:+6.1%}  probe before {before:+6.1%}  after "
                f"{after:+6.1%}  model {error:+6.1%}"
            )
        print(f"  the probes after: {', '.join(f'{m:+.1%}' for m in probes)}")
    print()
    failed = []
    for case, xs in found.items():
        if not xs:
            continue
        mean = statistics.fmean(xs)
        sd = statistics.pstdev(xs)
        interval = "one play"
        if len(xs) > 1:
            half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs))
            interval = f"95%: {mean - half:+.1%} to {mean + half:+.1%}"
        verdict = "within" if abs(mean) <= BOUND else "OUTSIDE"
        print(
            f"{case:16s} model mean {mean:+.1%} ({interval}), {verdict} {BOUND:.0%}; "
            f"sd {sd:.1%} a play, {_within(xs)}"
        )
        if abs(mean) > BOUND:
            failed.append(case)
    if noise:
        print(
            f"the probes' spread within a run (max - min, the machine alone): median "
            f"{statistics.median(noise):.1%}, {min(noise):.1%} to {max(noise):.1%} "
            f"over {len(noise)} runs"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
