"""Fitting a `StepModel` (outrate/simulate/stepmodel.py) to a real engine's
trace (`--outrate-trace`): `outrate simulate calibrate --trace`, and the
step-length error of a model on a trace it was not fitted on.

`calibrate` fits the model to the engine's own record (`--outrate-trace`):
the time between two consecutive steps is the first one's length, the
tokens it charged are its batch. A step's prompt tokens are in the trace
when the engine's policy limits prompts (`prompt`: what each user's chunks
computed in that step, charged at dispatch): then they are read as they
are. Otherwise, given the workload that ran, each new request a step
started (a user's charged count rising without a release) is counted with
the mean prompt of its user: all of it in the step of its first token,
where a chunked prompt was computed over several. Without either the
prompt cost is kept from `base`.

The fit is ordinary least squares on every step but the ones the engine
idled after (longer than `IDLE_FACTOR` x the median): a mean-unbiased model,
because throughput follows the mean step, stalls included.

Where the trace's waits differ enough to show it, the fit also picks how
the wake cost grows with the wait (`wake_tau_us`, one of WAKE_TAUS_US) by
the least squared error (docs/simulate.md, "The step-time model"). Where
the trace holds requests (its `held` counts), it fits what a step pays for
each request it holds (`per_held_us`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from outrate.errors import OutrateError
from outrate.simulate.stepmodel import StepModel
from outrate.simulate.workload import Workload

IDLE_FACTOR = 10
"""A gap longer than this many median steps is the engine waiting, not a step."""
MIN_WOKE = 5
"""Steps after an idle one, and steps not after one, needed to fit the wake
cost (fewer of either: it is kept); steps that held a request, and steps
that held none, needed to fit the hold cost."""
WAIT_SPREAD = 4
"""How far apart (a ratio) the trace's waits must be to fit how the wake
cost grows with them: the MIN_WOKE-th shortest and longest."""
WAKE_TAUS_US = (0.0, 500.0, 1000.0, 2000.0, 4000.0, 8000.0, 16000.0, 32000.0)
"""The time constants calibrate tries for the wake cost (0: all of it after
any wait)."""


@dataclass(frozen=True)
class Calibration:
    model: StepModel
    steps: int
    """Steps the fit used."""
    skipped: int
    """Step pairs left out: the engine idled after the step."""
    mean_step_us: float
    r2: float
    prefill_fitted: bool
    notes: list[str] = field(default_factory=list)
    residual_rms_us: float = 0.0
    residual_p50_us: float = 0.0
    """Median |measured - modelled| step length."""
    residual_p90_us: float = 0.0
    mean_error: float = 0.0
    """(modelled - measured) total time over the kept steps, as a share: what
    throughput is off by on the calibration run itself (0 by construction of
    least squares with a free fixed cost; not 0 when a coefficient was pinned)."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"] = self.model.to_json()
        return out

    def describe(self) -> str:
        lines = [
            self.model.describe(),
            f"fitted on {self.steps} steps (mean {self.mean_step_us:.0f}us, R^2 {self.r2:.2f});"
            f" {self.skipped} idle gaps left out",
            f"residuals: rms {self.residual_rms_us:.0f}us, |error| p50 "
            f"{self.residual_p50_us:.0f}us, p90 {self.residual_p90_us:.0f}us a step; total time "
            f"{self.mean_error:+.1%}",
            *self.notes,
        ]
        return "\n".join(lines)

    def fit_line(self, source: str) -> str:
        """One line for the model file: what the model was fitted on, how well."""
        return (
            f"fitted on {self.steps} steps of {source}: mean {self.mean_step_us:.0f}us, "
            f"residual rms {self.residual_rms_us:.0f}us, R^2 {self.r2:.2f}"
        )


def _solve(rows: list[list[float]], ys: list[float], free: list[int]) -> list[float]:
    """Least squares over the columns in `free` (normal equations, Gauss-Jordan)."""
    k = len(free)
    a = [[sum(r[i] * r[j] for r in rows) for j in free] for i in free]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in free]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise OutrateError("the trace does not vary enough to fit the step model")
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(k)]


def fit_nonnegative(
    rows: list[list[float]], ys: list[float], fixed: dict[int, float]
) -> list[float]:
    """Least squares with every coefficient >= 0: a negative one is pinned at
    0 and the rest refitted (columns in `fixed` are given, not fitted)."""
    pinned = dict(fixed)
    while True:
        free = [i for i in range(len(rows[0])) if i not in pinned]
        adj = [y - sum(r[i] * v for i, v in pinned.items()) for r, y in zip(rows, ys, strict=True)]
        coef = _solve(rows, adj, free)
        out = [0.0] * len(rows[0])
        for i, v in pinned.items():
            out[i] = v
        worst = min(range(len(free)), key=lambda j: coef[j])
        if coef[worst] >= 0:
            for j, i in enumerate(free):
                out[i] = coef[j]
            return out
        pinned[free[worst]] = 0.0


def calibrate(
    lines: Iterable[dict[str, Any]],
    workload: Workload | None = None,
    base: StepModel | None = None,
    source: str = "trace",
) -> Calibration:
    """Fit a StepModel to a trace's step lines (`read_trace`). `workload`: the
    one that ran (None: the prompt cost and the turnaround stay `base`'s)."""
    base = base or StepModel()
    steps = {r["step"]: r for r in lines if "step" in r and "t" in r}
    if len(steps) < 10:
        raise OutrateError(f"{source}: fewer than 10 steps in the trace: nothing to fit")
    traced = traces_prompts(steps.values())
    prompt_means = prompt_means_of(workload) if workload is not None and not traced else None
    samples = _samples(steps, prompt_means, traced)
    if len(samples) < 10:
        raise OutrateError(f"{source}: fewer than 10 consecutive steps with tokens: nothing to fit")
    kept = _busy(samples)
    ys = [s[-1] for s in kept]
    fitted = prompt_means is not None or traced
    fixed = {} if fitted else {2: base.per_prefill_us}
    notes = []
    if traced:
        notes.append("prompt tokens per step read from the trace (its policy limits prompts)")
    if workload is None and traced:
        notes.append(f"turnaround kept ({base.turnaround_us:g}us): pass the workload to fit it")
    elif workload is None:
        notes.append(
            f"prompt cost and turnaround kept ({base.per_prefill_us:g}us/token, "
            f"{base.turnaround_us:g}us): pass the workload (--workload) to fit them"
        )
    base_of = {1: base.per_decode_us, 2: base.per_prefill_us}
    for col, what in ((1, "per-decode"), (2, "prompt")):  # a sample's decode, prompt: col - 1
        if col not in fixed and len({s[col - 1] for s in kept}) < 2:
            fixed[col] = base_of[col]  # constant: not separable from the fixed part
            notes.append(f"the {what} count never varied: its cost is kept")
    occasional = (  # a sample's wait, held count: col - 1; fitted only where both kinds show
        (3, "after an idle one", "with a wait", "without a wait", "wake cost", base.wake_us),
        (4, "held a request", "that did", "that did not", "hold cost", base.per_held_us),
    )
    for col, what, did, did_not, cost, value in occasional:
        count = sum(s[col - 1] > 0 for s in kept)
        if min(count, len(kept) - count) < MIN_WOKE:  # too few either way: not separable
            fixed[col] = value
            notes.append(
                f"{count} of {len(kept)} steps {what} (fewer than {MIN_WOKE} "
                f"{did if count < MIN_WOKE else did_not}): {cost} kept ({value:g}us)"
            )
    tau, coef, rows = _fit_wake(kept, fixed)
    mean = statistics.fmean(ys)
    predicted = [sum(c * x for c, x in zip(coef, r, strict=True)) for r in rows]
    errors = sorted(abs(y - p) for y, p in zip(ys, predicted, strict=True))
    ss_res = sum(e * e for e in errors)
    ss_tot = sum((y - mean) ** 2 for y in ys)
    turnaround = base.turnaround_us
    if workload is not None:
        found = _turnaround_us(steps, workload, mean)
        if found is None:
            notes.append("no unthrottled closed-loop user to measure the turnaround on: kept")
        else:
            turnaround = found
    model = StepModel(
        fixed_us=round(coef[0], 3),
        per_decode_us=round(coef[1], 3),
        per_prefill_us=round(coef[2], 3),
        turnaround_us=round(turnaround, 1),
        wake_us=round(coef[3], 3),
        wake_tau_us=tau,
        per_held_us=round(coef[4], 3),
        source=f"calibrated from {source}",
    )
    result = Calibration(
        model=model,
        steps=len(kept),
        skipped=len(samples) - len(kept),
        mean_step_us=mean,
        r2=1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        prefill_fitted=2 not in fixed,
        notes=notes,
        residual_rms_us=(ss_res / len(ys)) ** 0.5,
        residual_p50_us=errors[len(errors) // 2],
        residual_p90_us=errors[min(len(errors) - 1, len(errors) * 9 // 10)],
        mean_error=(sum(predicted) - sum(ys)) / sum(ys) if sum(ys) > 0 else 0.0,
    )
    return replace(result, model=replace(model, fit=result.fit_line(source)))


def _rows(kept: list[Sample], tau_us: float) -> list[list[float]]:
    """The fit's columns: 1, requests decoding, prompt tokens, the share of
    the wake cost paid (`StepModel.wake_share` with `tau_us`), requests held."""
    shape = StepModel(wake_tau_us=tau_us)
    return [[1.0, d, p, shape.wake_share(w), h] for d, p, w, h, _ in kept]


def _fit_wake(
    kept: list[Sample], fixed: dict[int, float]
) -> tuple[float, list[float], list[list[float]]]:
    """`wake_tau_us`, the coefficients that fit `kept` best and the fit's
    rows at that time constant: each of WAKE_TAUS_US where the waits are
    WAIT_SPREAD apart (`_waits_vary`; else 0, all of the cost after any
    wait), the least squared error kept, a tie keeping the smaller."""
    ys = [s[-1] for s in kept]
    taus = WAKE_TAUS_US if 3 not in fixed and _waits_vary(kept) else (0.0,)
    best: tuple[float, float, list[float], list[list[float]]] | None = None
    for tau in taus:
        rows = _rows(kept, tau)
        coef = fit_nonnegative(rows, ys, fixed)
        pairs = zip(rows, ys, strict=True)
        sse = sum((y - sum(c * x for c, x in zip(coef, r, strict=True))) ** 2 for r, y in pairs)
        if best is None or sse < best[0]:
            best = (sse, tau, coef, rows)
    assert best is not None  # taus is never empty
    return best[1], best[2], best[3]


def _waits_vary(kept: list[Sample]) -> bool:
    """Whether the waits before steps differ enough to tell how the wake
    cost grows with them: the MIN_WOKE-th longest at least WAIT_SPREAD x
    the MIN_WOKE-th shortest (a wait the trace cannot size, its first
    step's, left out)."""
    waits = sorted(s[2] for s in kept if 0 < s[2] < math.inf)
    return len(waits) >= 2 * MIN_WOKE and waits[-MIN_WOKE] >= WAIT_SPREAD * waits[MIN_WOKE - 1]


Sample = tuple[float, float, float, float, float]
"""(requests decoding, prompt tokens, how long the engine waited before the
step in us (0: the step before it ran; inf: not known), requests the step
held, step length in us)."""


def _busy(samples: list[Sample]) -> list[Sample]:
    """The samples but those the engine idled after (longer than IDLE_FACTOR
    x the median step)."""
    median = statistics.median(s[-1] for s in samples)
    return [s for s in samples if s[-1] <= IDLE_FACTOR * median]


def traces_prompts(lines: Iterable[dict[str, Any]]) -> bool:
    """Whether a trace counts each step's prompt tokens: its engine's policy
    limited prompts (then every user's chunks are charged and written as
    `prompt`; without a prompt limit no line has the field)."""
    return any("prompt" in r for r in lines)


def _samples(
    steps: dict[int, dict[str, Any]],
    prompt_means: dict[str, float] | None,
    traced: bool = False,
    user: str | None = None,
) -> list[Sample]:
    """A sample per traced step followed by the next one (its length).
    `traced`: the prompt tokens are the step's own `prompt` counts, and its
    requests decoding those charged less its first tokens (`first`).
    `user`: only the steps that charged that user. A step
    follows one that ran nothing (woke) when the step before it has no line
    (nothing to say: it scheduled nothing), or a line without tokens (only
    held requests), or came more than IDLE_FACTOR x the median step before
    it (the engine waited for a request); the wait is the time since the
    last step that ran started, less the median step (its own length)."""
    default_prompt = statistics.fmean(prompt_means.values()) if prompt_means else 0.0

    def ran(rec: dict[str, Any] | None) -> bool:
        return rec is not None and bool(rec.get("charged") or (traced and rec.get("prompt")))

    gaps = [steps[n + 1]["t"] - r["t"] for n, r in steps.items() if ran(r) and n + 1 in steps]
    median_ns = statistics.median(gaps) if gaps else 0
    idle_ns = IDLE_FACTOR * median_ns
    samples: list[Sample] = []
    ran_at: int | None = None  # when the last step that ran started
    for number, rec in steps.items():
        if not ran(rec):
            continue
        ran_before, ran_at = ran_at, rec["t"]
        nxt = steps.get(number + 1)
        charged: dict[str, int] = rec.get("charged", {})
        prompt: dict[str, int] = rec.get("prompt", {})
        if nxt is None or (user is not None and not charged.get(user)):
            continue
        last = steps.get(number - 1)
        waited = 0.0
        if last is None or not ran(last) or rec["t"] - last["t"] > idle_ns:
            # the step that ran before it took about the median step
            known = ran_before is not None
            waited = max((rec["t"] - ran_before - median_ns) / 1000, 1.0) if known else math.inf
        refunded: dict[str, int] = rec.get("refunded", {})
        released: dict[str, int] = rec.get("released", {})
        before: dict[str, int] = last.get("charged", {}) if last is not None else {}
        n = sum(charged.values()) - sum(refunded.values())
        new = {
            u: max(0, k - refunded.get(u, 0) - before.get(u, 0) - released.get(u, 0))
            for u, k in charged.items()
        }
        prefill = 0.0
        started = sum(new.values())
        if traced:  # what the step computed, and the requests it gave a first token
            prefill = float(sum(prompt.values()))
            started = sum(rec.get("first", {}).values())
        elif prompt_means is not None:
            prefill = sum(k * prompt_means.get(u, default_prompt) for u, k in new.items())
        held = float(sum(rec.get("held", {}).values()))
        samples.append((n - started, prefill, waited, held, (nxt["t"] - rec["t"]) / 1000))
    return samples


def time_error(
    model: StepModel,
    lines: Iterable[dict[str, Any]],
    workload: Workload,
    user: str | None = None,
) -> float:
    """How far the model's step lengths are from a trace's, as a share of the
    measured total: (modelled - measured) / measured over its busy steps (the
    idle gaps left out as `calibrate` does); with `user`, over the steps
    that charged that user only. On a run the model was not fitted on, it
    says how much of a rate error is the step length (the machine's load
    moved, or the batch left the fitted range) rather than the scheduling."""
    steps = {r["step"]: r for r in lines if "step" in r and "t" in r}
    prompts = prompt_means_of(workload)
    samples = _samples(steps, prompts, traces_prompts(steps.values()), user)
    if not samples:
        return 0.0
    kept = _busy(samples)
    measured = sum(s[-1] for s in kept)
    modelled = sum(model.step_ns(int(d), int(p), w, int(h)) / 1000 for d, p, w, h, _ in kept)
    return (modelled - measured) / measured if measured > 0 else 0.0


def decode_step_us(lines: Iterable[dict[str, Any]], workload: Workload) -> dict[int, list[float]]:
    """Per number of requests decoding, the lengths (us) of a trace's steps
    that computed no prompt and did not follow an idle one, idle gaps left
    out as `calibrate` does. Two runs on one machine share such steps
    whatever their workloads, so their lengths compared say how the machine
    moved without asking any model."""
    steps = {r["step"]: r for r in lines if "step" in r and "t" in r}
    samples = _samples(steps, prompt_means_of(workload), traces_prompts(steps.values()))
    if not samples:
        return {}
    out: dict[int, list[float]] = {}
    for decoding, prefill, waited, _, us in _busy(samples):
        if prefill == 0 and not waited:
            out.setdefault(int(decoding), []).append(us)
    return out


def _turnaround_us(
    steps: dict[int, dict[str, Any]], workload: Workload, mean_step_us: float
) -> float | None:
    """The time a closed-loop stream spends between requests beyond its think
    time, from the steps it sat out: between a user's first and last token,
    each step it was charged for fewer tokens than it has streams is a
    stream between requests. Only users never held and never waiting for
    prompt budget (a throttled stream sits out for budget, not for its
    client) count, and a throttled user with one stream, whose requests'
    arrivals say it directly (`_one_stream_us`); the mean over them."""
    held = {u for r in steps.values() for f in ("held", "prompt_waiting") for u in r.get(f, {})}
    found = []
    for user, load in workload.expanded():
        if load.streams == 1 and user in held:
            gap = _one_stream_us(steps, user, mean_step_us)
            if gap is not None:
                think = load.think.mean / 1000 if load.think is not None else 0.0
                found.append(max(gap - think, 0.0))
            continue
        if load.streams is None or user in held:
            continue
        mine = [n for n, r in steps.items() if user in r.get("charged", {})]
        if len(mine) < 2:
            continue
        first, last = min(mine), max(mine)
        ramp_end = steps[first]["t"] + (load.ramp or 0)  # before it, streams are still starting
        while first < last and steps.get(first, {}).get("t", 0) < ramp_end:
            first += 1
        missing = 0
        tokens = 0
        for n in range(first, last + 1):
            k = steps.get(n, {}).get("charged", {}).get(user, 0)
            tokens += k
            missing += max(load.streams - k, 0)
        requests = tokens / max(load.output.mean, 1)
        if requests < 1:
            continue
        think = load.think.mean / 1000 if load.think is not None else 0.0
        found.append(max(missing * mean_step_us / requests - think, 0.0))
    return statistics.fmean(found) if found else None


def _one_stream_us(
    steps: dict[int, dict[str, Any]], user: str, mean_step_us: float
) -> float | None:
    """A one-stream user's mean time from a request's last token to its next
    request's arrival: each `arrived` step less the step after its last
    charged one (when that token existed). None: fewer than two arrivals
    after a token."""
    last = 0
    gaps = []
    for n in sorted(steps):
        r = steps[n]
        if user in r.get("arrived", {}) and last:
            gaps.append((r["t"] - last) / 1000 - mean_step_us)
        if user in r.get("charged", {}):
            last = r["t"]
    return statistics.fmean(gaps) if len(gaps) >= 2 else None


def prompt_means_of(workload: Workload) -> dict[str, float]:
    """Mean prompt length per user id of a `Workload` (groups spelled out)."""
    return {user: load.prompt.mean for user, load in workload.expanded()}
