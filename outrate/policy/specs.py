"""Limit specs: the one shape a limit is written in, wherever a limit goes.

A *limit spec* is written anywhere a limit goes (`default`, `anonymous`, each
user, tier and match entry) in one of these forms::

    100                      # tokens per second; fractions too: 0.5, 1/3
    unlimited
    {rate: 100, burst: 250ms, max_streams: 4}
    {rate: 20, peak: 200}    # or peak: unlimited: borrow idle capacity up to it
    {tier: pro}              # users, match entries, default, anonymous only
    {tier: pro, burst: 1s, max_streams: 2, peak: unlimited}   # a tier with overrides
    {rate: 20, prompt: 2000}  # and prompt tokens computed per second (`PromptRule`)
    {rate: 20, requests: 5}   # and at most 5 requests a second (`300/min` per minute)
    {rate: 20, quota: {output: 2M/day}}  # and 2M output tokens per UTC day (quotas.py)

With `tier`, only `burst`, `max_streams`, `shadow`, `peak`, `prompt`, `requests` and `quota` may be
overridden: a `rate` beside `tier` would make the tier name a lie, so it is an
error. A `peak` is checked against the rate it rises above: here when the rule
has its own rate (`peak_problem`), by the policy when the rate is its tier's.

Separate from the `Policy` (`outrate.policy.model`) and its sections because
these rules are the ones the compiler turns into limits: a reader of
`compile_policy` needs this module, not the rest of the file format.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from outrate.policy.quotas import QuotaField, written_quota
from outrate.policy.values import (
    RATE_SCHEMA,
    Duration,
    MaxStreams,
    Name,
    Pattern,
    Rate,
    RateValue,
    Requests,
    problem,
    shown,
)
from outrate.units import format_rate


class Strict(BaseModel):
    """Frozen, and unknown keys are errors: a typo must not silently drop a limit."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class _ScalarOrMapping:
    """Schema hook: a limit spec may be a bare rate as well as a mapping."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        return {"anyOf": [dict(RATE_SCHEMA), handler(core_schema)]}


_RATE_DOC = "Output tokens per second, or 'unlimited'."
Burst = Annotated[
    Duration | None,
    Field(
        description="How far ahead of the even pace a user may run; default: the policy's burst."
    ),
]
Streams = Annotated[
    MaxStreams | None,
    Field(
        description="At most this many of the user's requests run at once; more wait in the queue."
    ),
]


def _check_flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise problem(f"must be true or false (got {shown(value)})")
    return value


Flag = Annotated[bool, PlainValidator(_check_flag), WithJsonSchema({"type": "boolean"})]
Shadow = Annotated[
    Flag | None,
    Field(
        description="true: this limit is computed and counted (metrics: "
        "outrate_shadow_over_limit_tokens_total) but never enforced. Default: the "
        "policy's mode (a tier's setting passes to the users and patterns that use it)."
    ),
]


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


Peak = Annotated[
    Rate | None,
    WithJsonSchema(RATE_SCHEMA),  # no null: `peak: null` is an error (_written_peak)
    Field(
        description="Work-conserving limit: above its committed 'rate' a user may borrow "
        "capacity no committed request can use, up to this many tokens per second, or "
        "'unlimited'. At least 'rate' (equal: no borrowing); not on an unlimited rule. "
        "Default: no borrowing (a tier's peak passes to the users and patterns that use it).",
        json_schema_extra=_no_default,  # the default is "not written", and null is refused
    ),
]


def peak_problem(rate: RateValue, peak: RateValue, tier: str | None = None) -> str | None:
    """Why `peak` cannot sit above `rate` (the rule's own, or its `tier`'s), or None.

    One message for the rule's own check, the policy's check of a tier's rate,
    and the loader's located report of that check."""
    whose = "the rate" if tier is None else f"the rate of tier '{tier}'"
    if not isinstance(rate, Fraction):  # unlimited
        if tier is None:
            return "cannot be set on an unlimited rule: there is no rate to borrow above"
        return f"cannot be set here: tier '{tier}' is unlimited, there is no rate to borrow above"
    if isinstance(peak, Fraction) and peak < rate:
        return (
            f"must be at least {whose} ({format_rate(rate)} tok/s): the peak is the "
            "ceiling above the rate that borrowing may reach"
        )
    return None


NO_PEAK = (
    "must be a number of tokens per second or 'unlimited' (got nothing): leave 'peak' out "
    "for the default (no borrowing, or the tier's peak), or set it to the rate to borrow nothing"
)


def _written_peak(value: Any) -> Any:
    """`peak: null` (or an empty `peak:`) is an error, not "no peak": beside a
    tier it would keep the tier's peak where the writer may have meant none."""
    if value is None:
        raise problem(NO_PEAK)
    return value


def _check_peak(peak: RateValue | None, info: ValidationInfo) -> RateValue | None:
    """A rule's peak against its own rate (a tier's rate is the policy's to check)."""
    rate = info.data.get("rate")
    if peak is None or rate is None:
        return peak  # no peak; a tier's rate, or a rate already reported as bad
    message = peak_problem(rate, peak)
    if message is not None:
        raise problem(message)
    return peak


class _Spec(Strict):
    """What every limit spec shares: the bare-rate shorthand."""

    _kind: ClassVar[str] = "a number of tokens per second, 'unlimited', or a mapping"

    @model_validator(mode="before")
    @classmethod
    def _scalar_is_rate(cls, data: Any) -> Any:
        """`alice: 50` is short for `alice: {rate: 50}`."""
        if isinstance(data, dict):
            return data
        if isinstance(data, list | tuple) or data is None:
            raise problem(f"must be {cls._kind} (got {shown(data)})")
        return {"rate": data}


NO_PROMPT = (
    "must be a number of prompt tokens per second, 'unlimited', or a mapping (got nothing): "
    "leave 'prompt' out for the default (unlimited, or the tier's prompt limit)"
)


def _written_prompt(value: Any) -> Any:
    """`prompt: null` is an error, not "unlimited": beside a tier it would keep
    the tier's prompt limit where the writer may have meant none."""
    if value is None:
        raise problem(NO_PROMPT)
    return value


class PromptRule(_Spec):
    """A limit on the prompt tokens the engine computes for a user (prefix-cache
    hits and recomputation after a preemption are free), in the forms of an
    output limit: a rate, 'unlimited', or `{rate, burst, peak}`. Its own GCRA
    bucket; streams and shadow are the rule's (docs/prompt-limits.md)."""

    _kind = "a number of prompt tokens per second, 'unlimited', or a mapping"

    rate: Rate = Field(description="Prompt tokens computed per second, or 'unlimited'.")
    peak: Peak = None
    burst: Burst = None

    @field_validator("peak", mode="before")
    @classmethod
    def _peak_written(cls, value: Any) -> Any:
        return _written_peak(value)

    @field_validator("peak", mode="after")
    @classmethod
    def _peak_above_rate(cls, peak: RateValue | None, info: ValidationInfo) -> RateValue | None:
        return _check_peak(peak, info)


PromptSpec = Annotated[PromptRule, _ScalarOrMapping()]


class _NotNull:
    """Schema hook: an optional field whose `null` the loader refuses (the
    default is "not written")."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema: dict[str, Any] = handler(core_schema)
        branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
        if "anyOf" in schema:
            schema["anyOf"] = branches
        return schema


Prompt = Annotated[
    PromptSpec | None,
    _NotNull(),
    Field(
        description="Prompt tokens computed per second: a rate, 'unlimited', or "
        "{rate, burst, peak}. Default: unlimited (a tier's prompt passes to the users "
        "and patterns that use it).",
        json_schema_extra=_no_default,
    ),
]


NO_REQUESTS = (
    "must be a whole number of requests per second, 'N/s', 'N/min' or 'unlimited' (got "
    "nothing): leave 'requests' out for the default (unlimited, or the tier's)"
)


def _written_requests(value: Any) -> Any:
    """`requests: null` is an error, not "unlimited": beside a tier it would
    keep the tier's request rate where the writer may have meant none."""
    if value is None:
        raise problem(NO_REQUESTS)
    return value


RequestsField = Annotated[
    Requests | None,
    _NotNull(),
    Field(
        description="Requests per second or per minute ('5', '5/s', '300/min', "
        "'unlimited'), checked in the API server before tokenization: a request over it "
        "gets HTTP 429 with Retry-After. Default: unlimited (a tier's passes to the users "
        "and patterns that use it).",
        json_schema_extra=_no_default,
    ),
]


class TierRule(_Spec):
    """A named limit users and patterns can refer to. Cannot name another tier."""

    rate: Rate = Field(description=_RATE_DOC)
    peak: Peak = None
    burst: Burst = None
    max_streams: Streams = None
    shadow: Shadow = None
    prompt: Prompt = None
    requests: RequestsField = None
    quota: QuotaField = None

    @field_validator("peak", mode="before")
    @classmethod
    def _peak_written(cls, value: Any) -> Any:
        return _written_peak(value)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_written(cls, value: Any) -> Any:
        return _written_prompt(value)

    @field_validator("requests", mode="before")
    @classmethod
    def _requests_written(cls, value: Any) -> Any:
        return _written_requests(value)

    @field_validator("quota", mode="before")
    @classmethod
    def _quota_written(cls, value: Any) -> Any:
        return written_quota(value)

    @field_validator("peak", mode="after")
    @classmethod
    def _peak_above_rate(cls, peak: RateValue | None, info: ValidationInfo) -> RateValue | None:
        return _check_peak(peak, info)


class LimitRule(_Spec):
    """A limit spec: a rate of its own, or a tier with optional overrides.

    `tier` is declared before `rate`, and `rate` before `peak`, so the checks
    below can see them.
    """

    tier: Name | None = Field(
        default=None,
        description="Take rate, peak, burst, max_streams, prompt, requests and quota from this "
        "tier; all but rate may be overridden here.",
    )
    rate: Rate | None = Field(default=None, description=_RATE_DOC)
    peak: Peak = None
    burst: Burst = None
    max_streams: Streams = None
    shadow: Shadow = None
    prompt: Prompt = None
    requests: RequestsField = None
    quota: QuotaField = None

    @field_validator("peak", mode="before")
    @classmethod
    def _peak_written(cls, value: Any) -> Any:
        return _written_peak(value)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_written(cls, value: Any) -> Any:
        return _written_prompt(value)

    @field_validator("requests", mode="before")
    @classmethod
    def _requests_written(cls, value: Any) -> Any:
        return _written_requests(value)

    @field_validator("quota", mode="before")
    @classmethod
    def _quota_written(cls, value: Any) -> Any:
        return written_quota(value)

    @field_validator("peak", mode="after")
    @classmethod
    def _peak_above_rate(cls, peak: RateValue | None, info: ValidationInfo) -> RateValue | None:
        return _check_peak(peak, info)

    @field_validator("rate", mode="after")
    @classmethod
    def _not_with_tier(cls, rate: RateValue | None, info: ValidationInfo) -> RateValue | None:
        if rate is not None and info.data.get("tier") is not None:
            raise problem("cannot be set together with 'tier'; the tier brings its rate")
        return rate

    @model_validator(mode="after")
    def _rate_or_tier(self) -> LimitRule:
        if self.rate is None and self.tier is None:
            raise problem("needs a 'rate' (tokens per second or 'unlimited') or a 'tier'")
        return self


class MatchRule(LimitRule):
    """One ordered pattern entry; the first pattern matching a user id wins."""

    pattern: Pattern = Field(
        description="A glob over user ids (fnmatch: *, ?, [seq]), case-sensitive."
    )

    _kind: ClassVar[str] = "a mapping with 'pattern' and a limit"

    @model_validator(mode="before")
    @classmethod
    def _scalar_is_rate(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise problem(f"must be {cls._kind} (got {shown(data)})")
        return data


LimitSpec = Annotated[LimitRule, _ScalarOrMapping()]
FieldPath = tuple[str | int, ...]
TierSpec = Annotated[TierRule, _ScalarOrMapping()]
