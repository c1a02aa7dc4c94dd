"""Which term the step model misses: candidate terms tried on real traces of
tests/test_simulate_oos.py's server (docs/simulate.md, "Out of sample").

    python benchmarks/step_terms.py TRACE.jsonl [TRACE.jsonl ...]

Each trace holds the calibration run (e2e-agree.yaml), the three cases and
their probes, back to back. It is cut into workloads by which users each
step charged; the model `T = a + b D + c P` (outrate/simulate/tracefit.py's
samples: D requests decoding, P the workload's mean prompt per new request)
is fitted on the calibration part and asked about each case, then again
with one more term read from the trace per step. Plain least squares (no
>= 0 pins) and no correction for the machine's move: a screening tool.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from outrate.observe.trace import read_trace  # noqa: E402
from outrate.simulate.tracefit import IDLE_FACTOR, _samples, prompt_means_of  # noqa: E402
from outrate.simulate.workload import Workload, load_workload  # noqa: E402

NAMES = ("e2e-agree", "oos-hog", "oos-interactive", "oos-mix")
Line = dict[str, Any]
Term = Callable[[dict[int, Line], int], float]
"""A per-step term: the trace's steps by number, and the step's number."""


def _woke(steps: dict[int, Line], n: int) -> float:
    """1 for a step after one that ran nothing (the engine waited: a step
    that schedules nothing has no line, or one with only `held`)."""
    before = steps.get(n - 1)
    return float(before is None or not (before.get("charged") or before.get("prompt")))


TERMS: dict[str, Term] = {
    "released": lambda s, n: sum(s[n].get("released", {}).values()),
    "running": lambda s, n: s[n].get("running", 0),
    "held": lambda s, n: sum(s[n].get("held", {}).values()),
    "arrived": lambda s, n: sum(s[n].get("arrived", {}).values()),
    "woke": _woke,
}


def _label(r: Line, before: str | None) -> str | None:
    users = {u.split("-")[0] for f in ("charged", "arrived") for u in r.get(f, {})}
    if users & {"alice", "bob", "carol"}:
        return "e2e-agree"
    if "hog" in users and users & {"chat", "member"} or before == "oos-mix" and users:
        return "oos-mix"
    if users & {"chat", "member", "reader"}:
        return "oos-interactive"
    return "oos-hog" if "hog" in users else before


def segments(lines: list[Line]) -> list[tuple[str, list[Line]]]:
    """Consecutive steps of one workload, in trace order."""
    out: list[tuple[str, list[Line]]] = []
    label: str | None = None
    for r in (r for r in lines if "step" in r):
        label = _label(r, label)
        if label is None:
            continue
        if out and out[-1][0] == label and r["t"] - out[-1][1][-1]["t"] < 1.5e9:
            out[-1][1].append(r)
        else:
            out.append((label, [r]))
    return [(k, s) for k, s in out if (s[-1]["t"] - s[0]["t"]) > 10e9]  # probes are 5 s


def rows(seg: list[Line], w: Workload, term: Term) -> np.ndarray:
    """[1, D, P, term, measured us] per step, idle gaps left out."""
    steps = {r["step"]: r for r in seg}
    means = prompt_means_of(w)
    out = []
    for n, r in steps.items():
        if n + 1 not in steps or not r.get("charged"):
            continue
        near = {k: steps[k] for k in (n - 1, n, n + 1) if k in steps}
        d, p, _, _, y = _samples(near, means)[-1]  # step n's (n + 1 has no next here)
        out.append([1.0, d, p, term(steps, n), y])
    a = np.array(out)
    return a[a[:, 4] <= IDLE_FACTOR * statistics.median(a[:, 4])]


def error(coef: np.ndarray, a: np.ndarray, k: int) -> float:
    return float((a[:, :k] @ coef).sum() / a[:, 4].sum() - 1)


def pinned_on(base: np.ndarray, a: np.ndarray) -> tuple[float, float]:
    """The term's cost fitted on a case's own residuals (the calibration's
    three coefficients kept), and the case's error with it: what the term
    could explain were the calibration able to pin it (in sample: an upper
    bound on what it buys)."""
    residual = a[:, 4] - a[:, :3] @ base
    t = a[:, 3]
    k = float(residual @ t / (t @ t)) if (t @ t) > 0 else 0.0
    return k, error(np.append(base, k), a, 4)


def main(paths: list[str]) -> int:
    workloads = {
        n: load_workload(REPO / "examples" / "workloads" / f"{n}.yaml").workload for n in NAMES
    }
    for path in paths:
        segs = segments(read_trace(path))
        calib = next(s for k, s in segs if k == "e2e-agree")
        print(path)
        for k, s in segs:  # decode-only steps (no prompt), median ms by requests decoding
            a = rows(s, workloads[k], TERMS["released"])
            by = {
                int(d): float(np.median(a[(a[:, 1] == d) & (a[:, 2] == 0), 4])) / 1000
                for d in sorted(set(a[a[:, 2] == 0, 1]))
                if ((a[:, 1] == d) & (a[:, 2] == 0)).sum() >= 20
            }
            shown = ", ".join(f"{d}: {ms:.1f}" for d, ms in by.items())
            print(f"  {k}: {len(a)} steps; decode-only ms by requests decoding {{{shown}}}")
        for name, term in TERMS.items():
            c = rows(calib, workloads["e2e-agree"], term)
            base = np.linalg.lstsq(c[:, :3], c[:, 4], rcond=None)[0]
            more = np.linalg.lstsq(c[:, :4], c[:, 4], rcond=None)[0]
            cases = []
            for k, s in segs:
                if k != "e2e-agree":
                    a = rows(s, workloads[k], term)
                    cost, pinned = pinned_on(base, a)
                    cases.append(
                        f"{k} {error(base, a, 3):+.0%} -> {error(more, a, 4):+.0%}"
                        f" ({a[:, 3].mean():.2f} a step; pinned on the case {cost:.0f} us"
                        f" each -> {pinned:+.0%})"
                    )
            print(
                f"  + {name}: {more[3]:.0f} us each (calibration {c[:, 3].mean():.2f} a step); "
                + "; ".join(cases)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
