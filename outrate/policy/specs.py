"""Limit specs: the one shape a limit is written in, wherever a limit goes.

A *limit spec* is written anywhere a limit goes (`default`, `anonymous`, each
user, tier and match entry) in one of these forms::

    100                      # tokens per second; fractions too: 0.5, 1/3
    unlimited
    {rate: 100, burst: 250ms, max_streams: 4}
    {tier: pro}              # users, match entries, default, anonymous only
    {tier: pro, burst: 1s, max_streams: 2}   # a tier with overrides

With `tier`, only `burst` and `max_streams` may be overridden: a `rate` beside
`tier` would make the tier name a lie, so it is an error.

Separate from the `Policy` (`outrate.policy.model`) and its sections because
these rules are the ones the compiler turns into limits: a reader of
`compile_policy` needs this module, not the rest of the file format.
"""

from __future__ import annotations

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

from outrate.policy.values import (
    RATE_SCHEMA,
    Duration,
    MaxStreams,
    Name,
    Pattern,
    Rate,
    RateValue,
    problem,
    shown,
)


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


class TierRule(_Spec):
    """A named limit users and patterns can refer to. Cannot name another tier."""

    rate: Rate = Field(description=_RATE_DOC)
    burst: Burst = None
    max_streams: Streams = None
    shadow: Shadow = None


class LimitRule(_Spec):
    """A limit spec: a rate of its own, or a tier with optional overrides.

    `tier` is declared before `rate` so the rate check below can see it.
    """

    tier: Name | None = Field(
        default=None,
        description="Take rate, burst and max_streams from this tier; burst and "
        "max_streams may be overridden here, rate may not.",
    )
    rate: Rate | None = Field(default=None, description=_RATE_DOC)
    burst: Burst = None
    max_streams: Streams = None
    shadow: Shadow = None

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
