"""The scalar values of the workload format: token counts, times, request
rates, and the distributions a length or a think time may be drawn from.

Each parser gives the short message a file author sees, in the policy
format's words (`(got ...)` shows the value as written); the models in
workload.py compose them. Distributions sample with a `random.Random` the
caller seeds, so the simulator and the player (examples/workload_player.py)
draw the same requests from the same file.
"""

from __future__ import annotations

import math
import random
import re
from decimal import Decimal
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, model_validator

from outrate.policy.values import problem, shown

MAX_TOKENS = 10_000_000
"""A prompt or output longer than this is a typo, not a workload."""
MAX_TIME_NS = 7 * 24 * 3600 * 1_000_000_000
"""A week: longer simulated times are typos."""
MAX_REQUEST_RATE = 100_000
MIN_REQUEST_RATE = 0.000001
"""One request in about 12 days, longer than the longest run (a week). Below
it nothing arrives anyway, and the mean gap `1e9 / rate` ns overflows to inf
near 1e-300 (the arrivals' draw then divided by zero, after a 15 s start)."""

_TIME = re.compile(r"\s*(\+?(?:\d+\.?\d*|\.\d+))\s*(ns|us|µs|ms|s|m|h)\s*")
_UNIT_NS = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_TIME_EXPECTED = "must be a time like '500ms', '2s' or '5m'"


def parse_count(value: object) -> int:
    """A whole number of tokens, >= 1."""
    if isinstance(value, bool) or not isinstance(value, int | Decimal | float):
        raise problem(f"must be a whole number of tokens >= 1 (got {shown(value)})")
    if isinstance(value, Decimal | float) and (not math.isfinite(value) or value != int(value)):
        raise problem(f"must be a whole number of tokens >= 1 (got {shown(value)})")
    if value < 1:
        raise problem("must be >= 1")
    if value > MAX_TOKENS:
        raise problem(f"must be at most {MAX_TOKENS}")
    return int(value)


def parse_whole(value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise problem(f"must be a whole number (got {shown(value)})")
    if value < minimum:
        raise problem(f"must be >= {minimum}")
    return value


def parse_time(value: object) -> int:
    """A time with a unit to whole nanoseconds; 0 is allowed (`start: 0s`)."""
    if not isinstance(value, str):
        raise problem(f"{_TIME_EXPECTED}, with a unit (got {shown(value)})")
    m = _TIME.fullmatch(value)
    if m is None:
        raise problem(f"{_TIME_EXPECTED} (got {shown(value)})")
    ns = Decimal(m.group(1)) * _UNIT_NS[m.group(2)]
    if ns != ns.to_integral_value():
        raise problem("must be a whole number of nanoseconds")
    if ns > MAX_TIME_NS:
        raise problem("must be at most a week (168h)")
    return int(ns)


def parse_positive(value: object, what: str = "a number", limit: float = 1e9) -> float:
    if isinstance(value, bool) or not isinstance(value, int | Decimal | float):
        raise problem(f"must be {what} > 0 (got {shown(value)})")
    if not math.isfinite(value) or value <= 0:
        raise problem(f"must be {what} > 0 (got {shown(value)})")
    if value > limit:
        raise problem(f"must be at most {limit:g}")
    return float(value)


def parse_request_rate(value: object) -> float:
    rate = parse_positive(value, "a number of requests per second", MAX_REQUEST_RATE)
    if rate < MIN_REQUEST_RATE:
        raise problem(
            f"must be at least {MIN_REQUEST_RATE:f} requests per second (one request in "
            "about 12 days; the longest run is a week)"
        )
    return rate


_TIME_SCHEMA: dict[str, Any] = {
    "type": "string",
    "pattern": r"^\s*\+?(\d+\.?\d*|\.\d+)\s*(ns|us|µs|ms|s|m|h)\s*$",
    "description": "A time with a unit: ns, us, ms, s, m or h (e.g. '500ms', '2s').",
}
Count = Annotated[
    int,
    PlainValidator(parse_count),
    WithJsonSchema({"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}),
]
Time = Annotated[int, PlainValidator(parse_time), WithJsonSchema(_TIME_SCHEMA)]
Sigma = Annotated[
    float,
    PlainValidator(lambda v: parse_positive(v, "a number", 10)),
    WithJsonSchema({"type": "number", "exclusiveMinimum": 0, "maximum": 10}),
]
RequestRate = Annotated[
    float,
    PlainValidator(parse_request_rate),
    WithJsonSchema({"type": "number", "minimum": MIN_REQUEST_RATE, "maximum": MAX_REQUEST_RATE}),
]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_KINDS = ("fixed", "uniform", "exponential", "lognormal", "choice")


class _Dist(_Strict):
    """A value drawn per request: written as a plain value (fixed), or as a
    mapping with one of `uniform: [lo, hi]`, `exponential: MEAN`,
    `lognormal: MEDIAN` (with `sigma`, default 0.5) or `choice: [a, b, ...]`,
    optionally clamped by `min` and `max`."""

    _unit: ClassVar[str] = "a value"
    _floor: ClassVar[int] = 0

    @model_validator(mode="before")
    @classmethod
    def _plain_is_fixed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return data
        if isinstance(data, list | tuple) or data is None:
            raise problem(f"must be {cls._unit} or a distribution (got {shown(data)})")
        return {"fixed": data}

    @model_validator(mode="after")
    def _one_kind(self) -> _Dist:
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            names = ", ".join(_KINDS[1:])
            found = f" (got {', '.join(given)})" if given else ""
            raise problem(f"needs exactly one of {names}{found}")
        uniform = getattr(self, "uniform", None)
        if uniform is not None and uniform[0] > uniform[1]:
            raise problem("uniform: the low end must not exceed the high end")
        if self.sigma is not None and given[0] != "lognormal":
            raise problem("'sigma' goes with 'lognormal'")
        lo, hi = getattr(self, "min", None), getattr(self, "max", None)
        if lo is not None and hi is not None and lo > hi:
            raise problem("'min' must not exceed 'max'")
        if self.choice is not None and not self.choice:
            raise problem("choice: must list at least one value")
        return self

    def sample(self, rng: random.Random) -> int:
        """One draw, rounded to a whole unit and clamped to [min, max]."""
        fixed = getattr(self, "fixed", None)
        if fixed is not None:
            return int(fixed)
        if self.uniform is not None:
            lo, hi = self.uniform
            value = float(rng.randint(lo, hi)) if self._floor else rng.uniform(lo, hi)
        elif self.exponential is not None:
            value = rng.expovariate(1.0 / self.exponential) if self.exponential else 0.0
        elif self.lognormal is not None:
            value = rng.lognormvariate(math.log(self.lognormal), self.sigma or 0.5)
        else:
            value = float(rng.choice(self.choice))
        out = max(round(value), self._floor)
        lo, hi = getattr(self, "min", None), getattr(self, "max", None)
        if lo is not None:
            out = max(out, lo)
        if hi is not None:
            out = min(out, hi)
        return out

    @property
    def mean(self) -> float:
        """The mean before rounding and clamps (for summaries)."""
        if self.fixed is not None:
            return float(self.fixed)
        if self.uniform is not None:
            return float(self.uniform[0] + self.uniform[1]) / 2
        if self.exponential is not None:
            return float(self.exponential)
        if self.lognormal is not None:
            return float(self.lognormal) * math.exp((self.sigma or 0.5) ** 2 / 2)
        return float(sum(self.choice)) / len(self.choice)

    @property
    def largest(self) -> int | None:
        """The largest value a draw can take, or None when unbounded."""
        hi: int | None = getattr(self, "max", None)
        if self.fixed is not None:
            top: int | None = self.fixed
        elif self.uniform is not None:
            top = self.uniform[1]
        elif self.choice is not None:
            top = max(self.choice)
        else:
            top = None
        if hi is not None:
            return hi if top is None else min(top, hi)
        return top

    # Declared by the subclasses with their value type.
    fixed: Any
    uniform: Any
    exponential: Any
    lognormal: Any
    choice: Any
    sigma: Any


class TokenDist(_Dist):
    """A length in tokens drawn per request: a number, or a mapping with one of
    uniform, exponential, lognormal or choice (optionally min and max)."""

    _unit: ClassVar[str] = "a number of tokens"
    _floor: ClassVar[int] = 1

    fixed: Count | None = None
    uniform: tuple[Count, Count] | None = Field(default=None, description="[low, high], inclusive")
    exponential: Count | None = Field(default=None, description="the mean")
    lognormal: Count | None = Field(default=None, description="the median")
    sigma: Sigma | None = Field(default=None, description="lognormal's shape (default 0.5)")
    choice: tuple[Count, ...] | None = Field(default=None, description="equally likely values")
    min: Count | None = None
    max: Count | None = None


class TimeDist(_Dist):
    """A time drawn per request: a time like '500ms', or a mapping with one of
    uniform, exponential, lognormal or choice (optionally min and max)."""

    _unit: ClassVar[str] = "a time like '500ms'"

    fixed: Time | None = None
    uniform: tuple[Time, Time] | None = Field(default=None, description="[low, high]")
    exponential: Time | None = Field(default=None, description="the mean")
    lognormal: Time | None = Field(default=None, description="the median")
    sigma: Sigma | None = Field(default=None, description="lognormal's shape (default 0.5)")
    choice: tuple[Time, ...] | None = Field(default=None, description="equally likely values")
    min: Time | None = None
    max: Time | None = None

    @model_validator(mode="after")
    def _lognormal_positive(self) -> TimeDist:
        if self.lognormal == 0:
            raise problem("lognormal: the median must be > 0")
        return self
