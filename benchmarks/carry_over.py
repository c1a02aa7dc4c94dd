"""The step model's carry-over, over many runs: tests/test_simulate_oos.py's
judge replayed on the traces its server left (docs/simulate.md, "Out of
sample"; issue 40, item 8).

    python benchmarks/carry_over.py [TRACE.jsonl ...]

With no argument it reads every `/tmp/outrate-quiet-*/test_simulate_oos/
trace.jsonl` (each `make test` leaves one: tests/sim_servers.py). A trace
holds the plays of one run back to back, each after the engine went idle:
the 3 s warm-up, the 15 s calibration (e2e-agree.yaml), e2e-idle.yaml, then
each case (oos-hog, oos-interactive, oos-mix: 20 s) followed by its 5 s
probe (e2e-agree.yaml again), a case played twice where the test replayed
it. The plays are told apart by the idle gaps between them and by the
users each step charged.

For every case play it computes what the test does, with the step model of
this checkout (tests/sim_drift.py, outrate/simulate/stepmodel.py): the
model fitted on the calibration and e2e-idle, its error on the case's steps
(`raw`), the probe's decode-only steps against the calibration's (`probe`:
the machine, no model asked) and the model's own error, the machine taken
out (`model`). Then per case, over all runs: the mean and spread of `raw`
and `model`, and how many are within the test's 10%. Per run it also
prints the probes' spread: the same 5 s of the same workload, played minutes
apart, read against one calibration. That is the machine's own noise,
without any model.
"""

from __future__ import annotations

import glob
import math
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "examples")]

from sim_drift import machine_drift, model_error  # noqa: E402

from outrate.observe.trace import read_trace  # noqa: E402
from outrate.simulate.stepmodel import calibrate, decode_step_us, time_error  # noqa: E402
from outrate.simulate.workload import Workload, load_workload  # noqa: E402

WORKLOADS = REPO / "examples" / "workloads"
CASES = ("oos-hog", "oos-interactive", "oos-mix")
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
    if "member" in users:
        return "oos-mix" if "hog" in users else "oos-interactive"
    return "oos-hog" if "hog" in users else None


def judge(lines: list[Line], w: dict[str, Workload]) -> list[tuple[str, float, float]]:
    """(case, raw error, probe drift) for each case play of one trace, as
    tests/test_simulate_oos.py computes them."""
    cut = plays(lines)
    if len(cut) < 5 or case_of(cut[1]) or case_of(cut[2]):
        raise ValueError(f"not a run of test_simulate_oos: {len(cut)} plays")
    _, cal, idle, *rest = cut
    model = calibrate(cal + idle, w["e2e-agree"]).model
    reference = decode_step_us(cal, w["e2e-agree"])
    out = []
    for case_play, probe in zip(rest[0::2], rest[1::2], strict=False):
        case = case_of(case_play)
        if case is None or case_of(probe) is not None:
            break
        raw = time_error(model, case_play, w[case])
        out.append((case, raw, machine_drift(reference, decode_step_us(probe, w["e2e-agree"]))))
    return out


def _summary(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    within = sum(abs(x) <= BOUND for x in xs)
    return (
        f"mean {statistics.mean(xs):+.1%}, sd {statistics.pstdev(xs):.1%}, "
        f"within {BOUND:.0%} {within} of {len(xs)}"
    )


def main(paths: list[str]) -> int:
    paths = paths or sorted(glob.glob(DEFAULT_GLOB))
    if not paths:
        print(f"no traces: give TRACE.jsonl files, or run make test first ({DEFAULT_GLOB})")
        return 1
    w = {n: load_workload(WORKLOADS / f"{n}.yaml").workload for n in ("e2e-agree", *CASES)}
    found: dict[str, list[tuple[float, float]]] = {c: [] for c in CASES}
    noise = []
    for path in paths:
        try:
            judged = judge(list(read_trace(path)), w)
        except ValueError as e:
            print(f"{path}: skipped, {e}")
            continue
        probes = [m for _, _, m in judged]
        noise.append(max(probes) - min(probes))
        print(path)
        for case, raw, machine in judged:
            found[case].append((raw, machine))
            print(
                f"  {case:16s} raw {raw:+6.1%}  probe {machine:+6.1%}  "
                f"model {model_error(raw, machine):+6.1%}"
            )
        print(f"  the probes: {', '.join(f'{m:+.1%}' for m in probes)}")
    print()
    for case, rows in found.items():
        if rows:
            print(f"{case}: raw {_summary([r for r, _ in rows])}")
            print(f"{' ' * len(case)}  model {_summary([model_error(r, m) for r, m in rows])}")
    if noise:
        print(
            f"the probes' spread within a run (max - min, the machine alone): median "
            f"{statistics.median(noise):.1%}, {min(noise):.1%} to {max(noise):.1%} "
            f"over {len(noise)} runs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
