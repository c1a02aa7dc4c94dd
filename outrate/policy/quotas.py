"""`quota:` on a rule: output and/or prompt tokens per UTC calendar hour,
day, week or month (outrate.budget.quota says why calendar windows).

    quota: {output: 2M/day, prompt: 50M/day}
    quota: unlimited          # no quota (a tier's overridden)

An amount is a whole number of tokens with an optional suffix (`K`, `M`,
`G`: thousands, millions, billions) per window: `2M/day`, `500000/hour`,
`1.5M/week`. Every bad value is a located error with its own message.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from outrate.budget.quota import WINDOWS, Quota
from outrate.policy.values import UNLIMITED, problem, shown

MAX_QUOTA = 10**12
"""Tokens per window above which a quota is a typo, not a limit."""
SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}
_AMOUNT = re.compile(r"\s*([-+]?[\d_]+(?:\.\d*)?|[-+]?\.\d+)\s*([A-Za-z]*)\s*/\s*([A-Za-z]*)\s*")
_WINDOWS_TEXT = "'hour', 'day', 'week' or 'month'"
QUOTA_EXPECTED = f"must be a number of tokens per window like '2M/day' (per {_WINDOWS_TEXT})"
_RATE_WINDOWS = {"s", "sec", "second", "min", "minute", "ms"}
_SHORT = {"h": "hour", "hr": "hour", "d": "day", "w": "week", "wk": "week", "mo": "month"}


def parse_quota_amount(value: object) -> tuple[int, str]:
    """`2M/day` -> (2_000_000, 'day')."""
    if not isinstance(value, str):
        if isinstance(value, int | float) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise problem(f"must be a finite number of tokens per window (got {shown(value)})")
            raise problem(
                f"needs a window: write '{shown(value).strip(chr(39))}/day' (per "
                f"{_WINDOWS_TEXT}) (got {shown(value)})"
            )
        raise problem(f"{QUOTA_EXPECTED} (got {shown(value)})")
    m = _AMOUNT.fullmatch(value)
    if m is None:
        raise problem(f"{QUOTA_EXPECTED} (got {shown(value)})")
    number, suffix, window = m.groups()
    if window not in WINDOWS:
        hint = ""
        if window in _SHORT:
            hint = f" (did you mean '{_SHORT[window]}'?)"
        elif window in _RATE_WINDOWS:
            hint = " (seconds and minutes are rates: 'rate', 'prompt', 'requests')"
        raise problem(
            f"unknown window {shown(window)}: write tokens per {_WINDOWS_TEXT}{hint} "
            f"(got {shown(value)})"
        )
    if suffix.upper() not in SUFFIXES:
        raise problem(
            f"unknown unit {shown(suffix)}: write a number of tokens with K, M or G "
            f"(thousands, millions, billions) or none (got {shown(value)})"
        )
    try:
        amount = Decimal(number.replace("_", "")) * SUFFIXES[suffix.upper()]
    except InvalidOperation as e:  # pragma: no cover - the pattern admits numbers only
        raise problem(f"{QUOTA_EXPECTED} (got {shown(value)})") from e
    if amount <= 0:
        raise problem("must be > 0")
    if amount > MAX_QUOTA:
        raise problem(
            f"must be at most {MAX_QUOTA} tokens per window (1000G); leave 'quota' out for no quota"
        )
    if amount != int(amount):
        raise problem(f"must be a whole number of tokens (got {shown(value)})")
    return int(amount), window


def _quota_amount(value: object) -> tuple[int, str]:
    return parse_quota_amount(value)


def _dump_amount(value: tuple[int, str] | None) -> str | None:
    return None if value is None else f"{value[0]}/{value[1]}"


Amount = Annotated[
    tuple[int, str] | None,
    PlainValidator(_quota_amount),
    PlainSerializer(_dump_amount),
    WithJsonSchema(
        {
            "type": "string",
            "description": f"Tokens per UTC calendar {_WINDOWS_TEXT}: '2M/day', '500000/hour'.",
            "pattern": r"^\s*\+?[\d_]*\.?\d+\s*[KMGkmg]?\s*/\s*(hour|day|week|month)\s*$",
        }
    ),
]


class QuotaRule(BaseModel):
    """Quotas of one rule; `unlimited` is the rule with none (a tier's overridden)."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # as specs.Strict

    output: Amount = Field(default=None, description="Output tokens per window.")
    prompt: Amount = Field(default=None, description="Prompt tokens per window.")

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if data == UNLIMITED:
            return {}
        if not isinstance(data, dict):
            raise problem(
                "must be a mapping like {output: 2M/day, prompt: 50M/day}, or 'unlimited' "
                f"(got {shown(data)})"
            )
        if not data:
            raise problem(
                "names no quota: write 'output' and/or 'prompt' (like {output: 2M/day}), "
                "or 'unlimited'"
            )
        for key, value in data.items():
            if value is None and key in ("output", "prompt"):
                raise problem(f"{QUOTA_EXPECTED} (got nothing): leave '{key}' out for none")
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        """`unlimited` dumps as it was written: `{}` would not load back
        (a mapping must name a quota)."""
        if self.output is None and self.prompt is None:
            return UNLIMITED
        return handler(self)

    def quotas(self) -> tuple[Quota, ...]:
        out = []
        for kind in ("output", "prompt"):
            amount = getattr(self, kind)
            if amount is not None:
                out.append(Quota(kind, amount[0], amount[1]))
        return tuple(out)


NO_QUOTA = (
    "must be a mapping like {output: 2M/day}, or 'unlimited' (got nothing): leave 'quota' "
    "out for the default (none, or the tier's)"
)


def written_quota(value: Any) -> Any:
    """`quota: null` is an error, not "none": beside a tier it would keep the
    tier's quota where the writer may have meant none."""
    if value is None:
        raise problem(NO_QUOTA)
    return value


QuotaField = Annotated[
    QuotaRule | None,
    Field(
        description="Token quotas per UTC calendar hour, day, week or month: "
        "{output: 2M/day, prompt: 50M/day}, or 'unlimited'. Over it a request gets HTTP 429 "
        "(insufficient_quota) until the window resets. Default: none (a tier's passes to "
        "the users and patterns that use it).",
    ),
]
