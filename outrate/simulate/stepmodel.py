"""How long a simulated engine step takes, and how to learn it from a real
engine's trace.

The model is linear, as a step's cost is to first order:

    step = fixed + per_decode x (requests decoding one token)
                 + per_prefill x (prompt tokens computed)
                 + wake x (1 - exp(-wait / wake_tau)), for the first step
                   after the engine waited
                 + per_held x (requests the step holds)

The wake cost is what an engine pays to start again after a step that ran
nothing (outrate's idle wait for a throttled user's budget, or no request
at all): on vLLM's CPU platform here ~1.5 ms on a ~2.5 ms step after a wait
of 16-32 ms, less after a shorter one. A workload whose users are throttled
pays it on a fifth or more of its steps; one that keeps the engine busy
almost never. `calibrate` (outrate/simulate/tracefit.py) fits how it
grows with the wait (`wake_tau_us`) where the trace's waits are far
enough apart to show it; otherwise the whole of it is charged after any
wait (docs/simulate.md, "Out of sample").

A request outrate holds (its user out of budget) leaves the batch: the
step that holds it pays ~0.25-0.6 ms a request on vLLM's CPU platform here,
at the same number of requests decoding, in every workload tried, the
calibration's included (docs/simulate.md, "Found: what holding a request
costs"). A throttled user's streams are held and released all the time, so
a workload of many throttled streams pays it on a good share of its steps.

The defaults are rough figures for an 8B model in bf16 on one H100-class GPU
(7 ms a step, 40 us more per sequence decoding, 60 us per prompt token:
about 17k prompt tokens/s); they give sensible shapes, not your numbers.
Fit it to an engine's trace with `calibrate` (outrate/simulate/tracefit.py).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from outrate.errors import OutrateError
from outrate.fileread import MIB, FileLimit, decode_text, read_bounded

STEP_MODEL_FILE = FileLimit("a step model", MIB)
"""A model is a few numbers and a line of provenance."""


@dataclass(frozen=True)
class StepModel:
    fixed_us: float = 7000.0
    per_decode_us: float = 40.0
    per_prefill_us: float = 60.0
    turnaround_us: float = 0.0
    """A closed-loop stream's next request reaches the scheduler this long after
    its last token, beyond its think time: the API server and the client, both
    ways (`calibrate` measures it; 0 by default)."""
    wake_us: float = 0.0
    """Added to the first step after one that ran nothing, after a long
    wait (`calibrate` fits it from such steps, where the trace has enough
    of them; 0 by default)."""
    wake_tau_us: float = 0.0
    """How the wake cost grows with the wait: wake_us x (1 - exp(-wait /
    wake_tau_us)); 0: all of it after any wait."""
    per_held_us: float = 0.0
    """Added for each request the step holds: taken out of the batch, its
    user out of budget (`calibrate` fits it where the trace holds requests;
    0 by default)."""
    source: str = "defaults"
    fit: str = ""
    """How it was fitted, one line (`calibrate` writes it into the model file)."""

    def step_ns(self, decode: int, prefill: int, waited_us: float = 0.0, held: int = 0) -> int:
        """A step's length: `waited_us`, how long the engine waited before it
        (0: the step before it ran); `held`, requests it holds."""
        us = self.fixed_us + self.per_decode_us * decode + self.per_prefill_us * prefill
        us += self.wake_us * self.wake_share(waited_us) + self.per_held_us * held
        return max(int(us * 1000), 1)

    def wake_share(self, waited_us: float) -> float:
        """How much of the wake cost a step pays after waiting `waited_us`."""
        if waited_us <= 0:
            return 0.0
        return 1.0 if self.wake_tau_us <= 0 else -math.expm1(-waited_us / self.wake_tau_us)

    def describe(self) -> str:
        wake = f" + {self.wake_us:g}us after an idle step" if self.wake_us else ""
        if self.wake_us and self.wake_tau_us:
            wake += f" (1 - e^(-wait/{self.wake_tau_us / 1000:g}ms) of it)"
        held = f" + {self.per_held_us:g}us/request held" if self.per_held_us else ""
        return (
            f"step = {self.fixed_us:g}us + {self.per_decode_us:g}us/decode "
            f"+ {self.per_prefill_us:g}us/prompt token{wake}{held}; turnaround "
            f"{self.turnaround_us:g}us ({self.source})"
        )

    def provenance(self) -> str:
        """What the figures rest on: printed with every table."""
        if self.fit:
            return f"step model {self.fit}"
        if self.source == "defaults":
            return (
                "step model not fitted to any engine: rough figures for an 8B model on one "
                "H100-class GPU (fit yours: outrate simulate calibrate)"
            )
        return "step model given as is (no fit recorded with it)"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_step_model(path: str | os.PathLike[str]) -> StepModel:
    """A model written by `outrate simulate calibrate -o FILE` (JSON)."""
    source = os.fspath(path)
    try:
        data = json.loads(decode_text(read_bounded(source, STEP_MODEL_FILE), source))
    except json.JSONDecodeError as e:
        raise OutrateError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from e
    except RecursionError:  # json.loads recurses once per level of nesting
        raise OutrateError(f"{source}:1:1: invalid JSON: nested too deep") from None
    data = data.get("model", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise OutrateError(f"{source}: expected a JSON object with fixed_us, per_decode_us, ...")
    known = {
        "fixed_us",
        "per_decode_us",
        "per_prefill_us",
        "turnaround_us",
        "wake_us",
        "wake_tau_us",
        "per_held_us",
    }
    fit = data.get("fit", "")
    if not isinstance(fit, str):
        raise OutrateError(f"{source}: fit: must be a string (got {fit!r})")
    unknown = set(data) - known - {"source", "fit"}
    if unknown:
        raise OutrateError(f"{source}: unknown key {sorted(unknown)[0]!r}")
    values: dict[str, float] = {}
    for key in known & set(data):
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise OutrateError(f"{source}: {key}: must be a number >= 0 (got {v!r})")
        values[key] = float(v)
    return StepModel(**values, source=source, fit=fit)
