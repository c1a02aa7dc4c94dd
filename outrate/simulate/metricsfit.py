"""Fitting the step model to vLLM's counters (`counters`): `simulate
calibrate --metrics`, for the engines that run without `--outrate-trace`.

The step model is linear, so the steps of an interval between two readings
together take

    fixed x steps + per_decode x tokens decoded + per_prefill x prompt tokens

and while the engine was busy that is the interval's wall time. Each interval
is a sample (mean step, decode batch and prompt tokens a step) for
tracefit's least squares, weighted by its steps so that the fitted total
time is the measured one: the trace's regression, on averages.

What the counters cannot say: the turnaround (kept from the base model, and
the fit line says so); a step's own spread (the residuals are of an
interval's mean step); and when the engine idled. An interval without steps,
or with no request running at either end, is left out. Idle time inside an
interval with nothing running shows: the mean step (wall time over steps)
rises above the decoding requests' inter-token latency, which no token's
wait spans, and a note says so. A stall with requests running (all of them
held) lengthens both alike and is not seen. Averages hide which steps
carried the prompts, so the split between the three costs is less sure
than their total: the jackknife standard errors say how much. Intervals of
several engines are pooled into one fit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from outrate.errors import OutrateError
from outrate.simulate.counters import COUNTERS, STEPS, MetricsError, Reading
from outrate.simulate.stepmodel import StepModel
from outrate.simulate.tracefit import IDLE_FACTOR, fit_nonnegative
from outrate.units import format_count

MIN_INTERVALS = 5
"""The fewest busy intervals a fit is made from."""


@dataclass(frozen=True, slots=True)
class Interval:
    """What one engine did between two readings."""

    series: str
    seconds: float
    steps: float
    decoded: float
    prompt: float
    itl_seconds: float
    idle_at_an_end: bool
    """No request was running at its start or its end: the engine may have
    idled in it, and its wall time is then more than its steps took."""

    @property
    def mean_step_us(self) -> float:
        return self.seconds * 1e6 / self.steps


def intervals_of(readings: Iterable[Reading]) -> tuple[list[Interval], int]:
    """Consecutive readings of each series, differenced; and how many pairs
    were left out because a counter went down (the engine restarted)."""
    by_series: dict[str, list[Reading]] = {}
    for r in readings:
        by_series.setdefault(r.series, []).append(r)
    found: list[Interval] = []
    resets = 0
    for series, rs in by_series.items():
        rs.sort(key=lambda r: r.at_ns)
        for a, b in zip(rs, rs[1:], strict=False):
            if b.at_ns <= a.at_ns:
                continue
            d = {f: getattr(b, f) - getattr(a, f) for f in COUNTERS.values()}
            if min(d.values()) < 0:
                resets += 1
                continue
            found.append(
                Interval(
                    series=series,
                    seconds=(b.at_ns - a.at_ns) / 1e9,
                    steps=d["steps"],
                    decoded=d["decoded"],
                    # a scrape between the counter and the histogram can make it < 0
                    prompt=max(d["tokens"] - d["generated"], 0.0),
                    itl_seconds=d["itl_seconds"],
                    idle_at_an_end=a.running == 0 or b.running == 0,
                )
            )
    return found, resets


@dataclass(frozen=True)
class MetricsCalibration:
    model: StepModel
    intervals: int
    """Intervals the fit used."""
    steps: int
    """Engine steps in them."""
    skipped: int
    """Intervals left out: no steps, no request running at an end, or a reset."""
    mean_step_us: float
    """Their wall time over their steps."""
    itl_us: float | None
    """The decoding requests' mean inter-token latency in them (vLLM's histogram)."""
    r2: float
    prefill_fitted: bool
    notes: list[str] = field(default_factory=list)
    stderr_us: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Jackknife standard errors of (fixed, per decode, per prompt token): how
    sure the split between the three costs is (the total time is surer)."""
    residual_rms_us: float = 0.0
    """Of an interval's mean step (the page has no single step's length)."""
    residual_p50_us: float = 0.0
    residual_p90_us: float = 0.0
    mean_error: float = 0.0
    """(modelled - measured) total time over the kept intervals, as a share."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"] = self.model.to_json()
        out["stderr_us"] = [x if math.isfinite(x) else None for x in self.stderr_us]
        return out

    def describe(self) -> str:
        itl = f"; decoding requests' inter-token latency {self.itl_us:.0f}us" if self.itl_us else ""
        return "\n".join(
            [
                self.model.describe(),
                f"fitted on {self.intervals} intervals, {self.steps} steps (mean step "
                f"{self.mean_step_us:.0f}us{itl}; R^2 {self.r2:.2f}); "
                f"{format_count(self.skipped, 'interval')} left out",
                f"residuals of an interval's mean step: rms {self.residual_rms_us:.0f}us, |error| "
                f"p50 {self.residual_p50_us:.0f}us, p90 {self.residual_p90_us:.0f}us; total "
                f"time {self.mean_error:+.1%}",
                "standard errors (jackknife over the intervals): fixed +-{:.0f}us, per decode "
                "+-{:.1f}us, per prompt token +-{:.2f}us".format(*self.stderr_us),
                *self.notes,
            ]
        )


def calibrate_metrics(
    readings: Sequence[Reading], source: str, base: StepModel | None = None
) -> MetricsCalibration:
    """Fit a StepModel to readings of vLLM's counters (`read_metrics`). The
    turnaround, which the counters do not show, stays `base`'s; so does a
    cost whose count never varied."""
    base = base or StepModel()
    found, resets = intervals_of(readings)
    if not found:
        raise MetricsError(f"{source}: fewer than two readings of the engine's counters")
    span = sum(i.seconds for i in found) / len({i.series for i in found})
    busy = [i for i in found if i.steps > 0]
    if not busy:
        raise MetricsError(
            f"{source}: the engine took no steps in the {span:.0f}s read ({STEPS} did not "
            "move): read it while it serves a load"
        )
    running = [i for i in busy if not i.idle_at_an_end]
    median = statistics.median(i.mean_step_us for i in running) if running else 0.0
    kept = [i for i in running if i.mean_step_us <= IDLE_FACTOR * median]
    if len(kept) < MIN_INTERVALS:
        raise MetricsError(
            f"{source}: {len(kept)} of {len(found)} intervals had steps and requests running "
            f"throughout; {MIN_INTERVALS} are needed (a longer --window, a shorter --interval, "
            "or a busier engine)"
        )
    notes: list[str] = []
    fixed: dict[int, float] = {}
    base_of = {1: base.per_decode_us, 2: base.per_prefill_us}
    per_step = {1: [i.decoded / i.steps for i in kept], 2: [i.prompt / i.steps for i in kept]}
    for col, what in ((1, "decode batch"), (2, "prompt tokens a step")):
        xs = per_step[col]
        if max(xs) - min(xs) <= 1e-9 * max(1.0, abs(xs[0])):
            fixed[col] = base_of[col]  # constant: not separable from the fixed part
            notes.append(f"the {what} never varied: its cost is kept ({base_of[col]:g}us)")
    # Weighted by steps: rows and ys over sqrt(steps), so that the fitted
    # total time is the measured one (the normal equation of the fixed cost).
    rows = [[i.steps**0.5, i.decoded / i.steps**0.5, i.prompt / i.steps**0.5] for i in kept]
    ys = [i.seconds * 1e6 / i.steps**0.5 for i in kept]
    try:
        coef = fit_nonnegative(rows, ys, fixed)
    except OutrateError as e:
        raise MetricsError(
            f"{source}: the intervals do not vary enough to fit the step model (the decode "
            "batch and the prompt tokens a step must move between intervals)"
        ) from e
    measured = [i.mean_step_us for i in kept]
    modelled = [
        coef[0] + coef[1] * d + coef[2] * p for d, p in zip(*per_step.values(), strict=True)
    ]
    errors = sorted(abs(y - p) for y, p in zip(measured, modelled, strict=True))
    mean = statistics.fmean(measured)
    ss_res = sum(e * e for e in errors)
    ss_tot = sum((y - mean) ** 2 for y in measured)
    r2 = 1 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rms = (ss_res / len(kept)) ** 0.5
    steps = sum(i.steps for i in kept)
    mean_step = sum(i.seconds * 1e6 for i in kept) / steps
    decoded = sum(i.decoded for i in kept)
    itl_us = sum(i.itl_seconds for i in kept) * 1e6 / decoded if decoded else None
    skipped = len(found) - len(kept) + resets
    if skipped:
        why = (
            f"no steps, no request running at an end, or a mean step over {IDLE_FACTOR}x the median"
        )
        if resets:
            why += f"; {resets} where a counter went down (the engine restarted)"
        notes.append(f"{format_count(skipped, 'interval')} left out: {why}")
    if itl_us and mean_step > 1.25 * itl_us:
        notes.append(
            f"steps averaged {mean_step:.0f}us of wall time but decoding requests waited "
            f"{itl_us:.0f}us between tokens: the engine probably idled inside intervals, "
            "and the costs are overstated (a shorter --interval, or a busier window)"
        )
    series = sorted({i.series for i in kept})
    if len(series) > 1:
        notes.append(f"{len(series)} engines pooled into one model: {'; '.join(series)}")
    notes.append(
        f"turnaround kept ({base.turnaround_us:g}us): /metrics cannot show it "
        "(calibrate --trace with the workload fits it)"
    )
    kept_costs = [
        f"turnaround kept ({base.turnaround_us:g}us: /metrics cannot show it)",
        f"wake cost kept ({base.wake_us:g}us: /metrics cannot show idle steps)",
        f"hold cost kept ({base.per_held_us:g}us: /metrics cannot show a step's holds)",
    ]
    kept_costs += [
        f"{name} kept ({base_of[col]:g}us: its count never varied)"
        for col, name in ((1, "per-decode cost"), (2, "prompt cost"))
        if col in fixed
    ]
    model = StepModel(
        fixed_us=round(coef[0], 3),
        per_decode_us=round(coef[1], 3),
        per_prefill_us=round(coef[2], 3),
        turnaround_us=base.turnaround_us,
        wake_us=base.wake_us,
        wake_tau_us=base.wake_tau_us,
        per_held_us=base.per_held_us,
        source=f"calibrated from {source}",
    )
    fit = (
        f"fitted on {len(kept)} intervals ({steps:.0f} steps) of {source}: mean step "
        f"{mean_step:.0f}us, residual rms {rms:.0f}us of an interval's mean step, "
        f"R^2 {r2:.2f}; {'; '.join(kept_costs)}"
    )
    return MetricsCalibration(
        model=replace(model, fit=fit),
        intervals=len(kept),
        steps=round(steps),
        skipped=skipped,
        mean_step_us=mean_step,
        itl_us=itl_us,
        r2=r2,
        prefill_fitted=2 not in fixed,
        notes=notes,
        residual_rms_us=rms,
        residual_p50_us=errors[len(errors) // 2],
        residual_p90_us=errors[min(len(errors) - 1, len(errors) * 9 // 10)],
        mean_error=_mean_error(kept, coef),
        stderr_us=_jackknife(rows, ys, fixed),
    )


def _jackknife(
    rows: list[list[float]], ys: list[float], fixed: dict[int, float]
) -> tuple[float, float, float]:
    """Standard error of each coefficient: the fit again without each interval
    in turn, the spread of those fits scaled by (n - 1) / n."""
    n = len(rows)
    fits = []
    for leave in range(n):
        try:
            fits.append(
                fit_nonnegative(
                    rows[:leave] + rows[leave + 1 :], ys[:leave] + ys[leave + 1 :], fixed
                )
            )
        except OutrateError:  # that interval alone made it vary: as unsure as can be
            return (math.inf, math.inf, math.inf)
    means = [statistics.fmean(f[c] for f in fits) for c in range(3)]
    se = [math.sqrt((n - 1) / n * sum((f[c] - means[c]) ** 2 for f in fits)) for c in range(3)]
    return se[0], se[1], se[2]


def _mean_error(kept: Sequence[Interval], coef: Sequence[float]) -> float:
    measured = sum(i.seconds * 1e6 for i in kept)
    modelled = sum(coef[0] * i.steps + coef[1] * i.decoded + coef[2] * i.prompt for i in kept)
    return (modelled - measured) / measured if measured > 0 else 0.0
