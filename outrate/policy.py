"""The policy file format as pydantic models.

These models are the one definition of what a policy may say: the loader
validates against them, `outrate schema` exports them for editors, and the
compiler trusts what they accept. So every value rule lives here, with the short
human message a file author sees; the loader only adds the file and line.

Layout rules that keep the format growable: every model forbids unknown keys
(a typo is an error, not a silently ignored limit), and each section is its own
field of `Policy`, so a future `shadow:` or `metrics:` section is one new field.

A *limit spec* is written anywhere a limit goes (`default`, `anonymous`, each
user, tier and match entry) in one of these forms::

    100                      # tokens per second; fractions too: 0.5, 1/3
    unlimited
    {rate: 100, burst: 250ms, max_streams: 4}
    {tier: pro}              # users, match entries, default, anonymous only
    {tier: pro, burst: 1s, max_streams: 2}   # a tier with overrides

With `tier`, only `burst` and `max_streams` may be overridden: a `rate` beside
`tier` would make the tier name a lie, so it is an error.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from outrate.identity import (
    ANONYMOUS,
    MAX_IDENTITY_LEN,
    ON_CLAIM_MISMATCH,
    SOURCES,
    text_error,
)
from outrate.limiter import NS_PER_S, exact_rate
from outrate.units import format_duration

MAX_RATE = 1_000_000
"""Tokens per second above which a rate is a typo, not a limit."""
MIN_RATE = Fraction(1, 1_000_000)
"""Below one token in about 12 days a rate is a typo (or an underflow), not a limit."""
MAX_RATE_DIGITS = 30
"""Digits in a rate (or in each side of a fraction): exact arithmetic on longer
numbers costs the scheduler on every token, and nobody means them."""
MAX_BURST_NS = 3600 * NS_PER_S
"""A burst longer than this lets a user take hours of budget at once."""
DEFAULT_BURST_NS = 100_000_000
MAX_USER_ID_LEN = MAX_IDENTITY_LEN
MAX_NAME_LEN = MAX_IDENTITY_LEN
"""Tier names and patterns: as long as the longest id they could name."""
UNLIMITED: Literal["unlimited"] = "unlimited"

RateValue = Fraction | Literal["unlimited"]


def _problem(message: str) -> PydanticCustomError:
    """Our own error type, so the loader can show `message` as it is."""
    return PydanticCustomError("outrate", message)


def _shown(value: object) -> str:
    """A value as the file author wrote it (YAML spelling), for `(got ...)`."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return str(value)


# -- rates ------------------------------------------------------------------

_FRACTION = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
_RATE_EXPECTED = "must be a number of tokens per second or 'unlimited'"
_TOO_FAST = f"must be at most {MAX_RATE} tokens per second (use 'unlimited' for no limit)"
_TOO_SLOW = "must be at least 0.000001 tokens per second (one token in about 12 days)"
_MIN_RATE_DECIMAL = Decimal(MIN_RATE.numerator) / Decimal(MIN_RATE.denominator)


def parse_rate(value: object) -> RateValue:
    """A rate exactly as written: 0.1 stays 1/10 so pacing never drifts."""
    if isinstance(value, Fraction):  # from code, not YAML: the same digit cap as 'n/d'
        digits = max(len(str(value.numerator)), len(str(value.denominator)))
        if digits > MAX_RATE_DIGITS:
            raise _problem(f"must have at most {MAX_RATE_DIGITS} digits (got {digits})")
        rate = value
    elif isinstance(value, bool) or value is None:
        raise _problem(f"{_RATE_EXPECTED} (got {_shown(value)})")
    elif isinstance(value, int | Decimal | float):
        if not (value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)):
            raise _problem(
                f"must be a finite number; use 'unlimited' for no limit (got {_shown(value)})"
            )
        _check_magnitude(value)  # before exact_rate: 1e-999999999 is a billion-digit Fraction
        rate = exact_rate(value)
    elif isinstance(value, str):
        if value == UNLIMITED:
            return UNLIMITED
        m = _FRACTION.fullmatch(value)
        if m is None:
            raise _problem(f"{_RATE_EXPECTED} (got {_shown(value)})")
        digits = max(len(m.group(1)), len(m.group(2)))
        if digits > MAX_RATE_DIGITS:
            raise _problem(f"must have at most {MAX_RATE_DIGITS} digits (got {digits})")
        if int(m.group(2)) == 0:
            raise _problem(f"{_RATE_EXPECTED} (got {_shown(value)}, a division by zero)")
        rate = Fraction(int(m.group(1)), int(m.group(2)))
    else:
        raise _problem(f"{_RATE_EXPECTED} (got {_shown(value)})")
    if rate <= 0:
        raise _problem("must be > 0")
    if rate > MAX_RATE:
        raise _problem(_TOO_FAST)
    if rate < MIN_RATE:
        raise _problem(_TOO_SLOW)
    return rate


def _check_magnitude(value: int | Decimal | float) -> None:
    """Range and digits, compared without building the exact fraction."""
    if isinstance(value, Decimal):
        digits = len(value.as_tuple().digits)
        if value > 0 and digits > MAX_RATE_DIGITS:
            raise _problem(f"must have at most {MAX_RATE_DIGITS} digits (got {digits})")
    if value <= 0:
        raise _problem("must be > 0")
    if value > MAX_RATE:
        raise _problem(_TOO_FAST)
    if value < _MIN_RATE_DECIMAL:
        raise _problem(_TOO_SLOW)


def _dump_rate(rate: RateValue) -> int | float | str:
    """Plain YAML/JSON that parses back to the same exact rate."""
    if isinstance(rate, str):
        return rate
    if rate.denominator == 1:
        return rate.numerator
    if exact_rate(float(rate)) == rate:
        return float(rate)
    return f"{rate.numerator}/{rate.denominator}"


RATE_SCHEMA: dict[str, Any] = {
    "description": "Output tokens per second (> 0, at most 1000000; a fraction "
    "like 0.5 or '1/3' is kept exact) or 'unlimited'.",
    "anyOf": [
        {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_RATE},
        {"const": UNLIMITED},
        {"type": "string", "pattern": r"^\s*\d+\s*/\s*[1-9]\d*\s*$"},
    ],
}

Rate = Annotated[
    RateValue,
    PlainValidator(parse_rate),
    PlainSerializer(_dump_rate),
    WithJsonSchema(RATE_SCHEMA),
]


# -- durations --------------------------------------------------------------

_DURATION = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+))\s*(ns|us|µs|ms|s)\s*")
_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": NS_PER_S}
_DURATION_EXPECTED = "must be a duration like '100ms' or '0.25s'"


def parse_duration(value: object) -> int:
    """A duration string to whole nanoseconds, the limiter's clock unit."""
    if not isinstance(value, str):
        raise _problem(f"{_DURATION_EXPECTED}, with a unit (got {_shown(value)})")
    m = _DURATION.fullmatch(value)
    if m is None:
        raise _problem(f"{_DURATION_EXPECTED} (got {_shown(value)})")
    try:
        ns = Decimal(m.group(1)) * _UNIT_NS[m.group(2)]
    except InvalidOperation as e:  # pragma: no cover - the regex admits only decimals
        raise _problem(f"{_DURATION_EXPECTED} (got {_shown(value)})") from e
    if ns <= 0:
        raise _problem("must be > 0")
    if ns != ns.to_integral_value():
        raise _problem("must be a whole number of nanoseconds")
    if ns > MAX_BURST_NS:
        raise _problem("must be at most 3600s")
    return int(ns)


Duration = Annotated[
    int,
    PlainValidator(parse_duration),
    PlainSerializer(format_duration),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": r"^\s*\+?(\d+\.?\d*|\.\d+)\s*(ns|us|µs|ms|s)\s*$",
            "description": "A duration with a unit: ns, us, ms or s (e.g. '100ms', "
            "'0.25s'); > 0 and at most 3600s.",
        }
    ),
]


# -- small scalars ----------------------------------------------------------


def _parse_max_streams(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | Decimal | float):
        raise _problem(f"must be a whole number >= 1 (got {_shown(value)})")
    if isinstance(value, Decimal | float) and (not math.isfinite(value) or value != int(value)):
        raise _problem(f"must be a whole number >= 1 (got {_shown(value)})")
    if value < 1:
        raise _problem("must be >= 1")
    return int(value)


MaxStreams = Annotated[
    int,
    PlainValidator(_parse_max_streams),
    WithJsonSchema({"type": "integer", "minimum": 1}),
]


def must_be_string(what: str, written: str) -> str:
    """The hint for a name YAML read as something else (`12345`, `on`, `~`).

    `written` is how the author wrote it: the loader knows the spelling and
    re-renders this message with it (errors carry `ctx["quote"] == what`)."""
    return f"{what} must be a string; quote it: '{written}'"


def _not_a_string(what: str, value: object) -> PydanticCustomError:
    return PydanticCustomError("outrate", must_be_string(what, _shown(value)), {"quote": what})


def _check_text(what: str, value: str, limit: int) -> None:
    """The identity rules (outrate.identity) for any name a policy holds."""
    if len(value) > limit:
        raise _problem(f"{what} must be at most {limit} characters (got {len(value)})")
    bad = text_error(value)
    if bad is not None:
        raise _problem(f"{what} {bad}: {_shown(value)}")


def check_user_id(value: object) -> str:
    """User ids arrive from request bodies; reject ones no request can carry."""
    if not isinstance(value, str):
        raise _not_a_string("user id", value)
    if value == "":
        raise _problem("user id must not be empty")
    _check_text("user id", value, MAX_USER_ID_LEN)
    if value == ANONYMOUS:
        raise _problem(
            f"'{ANONYMOUS}' is reserved for requests without identity; "
            "set their limit with the top-level 'anonymous' key"
        )
    return value


UserId = Annotated[
    str,
    PlainValidator(check_user_id),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_USER_ID_LEN}),
]


def _name_checker(what: str) -> Any:
    def check(value: object) -> str:
        if not isinstance(value, str):
            raise _not_a_string(what, value)
        if value == "":
            raise _problem("must not be empty")
        _check_text(what, value, MAX_NAME_LEN)
        return value

    return check


_NAME_SCHEMA = WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_NAME_LEN})
Name = Annotated[str, PlainValidator(_name_checker("tier name")), _NAME_SCHEMA]
Pattern = Annotated[str, PlainValidator(_name_checker("pattern")), _NAME_SCHEMA]


def _check_version(value: object) -> int:
    if isinstance(value, str) and value.strip() == "1":
        raise _problem("must be the number 1, not the string '1'")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _problem(f"must be 1 (got {_shown(value)})")
    if value != 1:
        raise _problem(f"unsupported version {value}; this outrate reads version 1")
    return value


# -- limit specs ------------------------------------------------------------


class _Strict(BaseModel):
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
        raise _problem(f"must be true or false (got {_shown(value)})")
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


class _Spec(_Strict):
    """What every limit spec shares: the bare-rate shorthand."""

    _kind: ClassVar[str] = "a number of tokens per second, 'unlimited', or a mapping"

    @model_validator(mode="before")
    @classmethod
    def _scalar_is_rate(cls, data: Any) -> Any:
        """`alice: 50` is short for `alice: {rate: 50}`."""
        if isinstance(data, dict):
            return data
        if isinstance(data, list | tuple) or data is None:
            raise _problem(f"must be {cls._kind} (got {_shown(data)})")
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
            raise _problem("cannot be set together with 'tier'; the tier brings its rate")
        return rate

    @model_validator(mode="after")
    def _rate_or_tier(self) -> LimitRule:
        if self.rate is None and self.tier is None:
            raise _problem("needs a 'rate' (tokens per second or 'unlimited') or a 'tier'")
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
            raise _problem(f"must be {cls._kind} (got {_shown(data)})")
        return data


LimitSpec = Annotated[LimitRule, _ScalarOrMapping()]
FieldPath = tuple[str | int, ...]
TierSpec = Annotated[TierRule, _ScalarOrMapping()]

MODES = ("enforce", "shadow")


def _check_mode(value: object) -> str:
    if value not in MODES:
        raise _problem(f"must be 'enforce' or 'shadow' (got {_shown(value)})")
    return str(value)


MAX_SERIES_LIMIT = 100_000
"""More per-user series than this is a cardinality problem for any Prometheus."""


def _check_max_series(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _problem(f"must be a whole number (got {_shown(value)})")
    if value < 0:
        raise _problem("must be >= 0")
    if value > MAX_SERIES_LIMIT:
        raise _problem(f"must be at most {MAX_SERIES_LIMIT}")
    return value


class MetricsSection(_Strict):
    """Which users get Prometheus series of their own (bounded cardinality)."""

    per_user: tuple[Name, ...] = Field(
        default=(),
        description="Globs over user ids that get a series of their own (listed users "
        "always do). Everyone else is counted under the rule that matched them.",
    )
    max_series: Annotated[
        int, PlainValidator(_check_max_series), WithJsonSchema({"type": "integer", "minimum": 0})
    ] = Field(
        default=1000,
        description="At most this many per_user series (users listed in the policy always "
        "have theirs); past it, those users are counted under limit=other.",
    )


# -- identity -----------------------------------------------------------------

_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP field name (RFC 9110 token)."""
_NOT_IDENTITY_HEADERS = {
    "authorization": "use 'source: api_key' for Authorization: Bearer keys",
    "proxy-authorization": "it is meant for the proxy, not for vLLM",
    "cookie": "browsers send it on their own",
    "host": "every client sets it",
    "content-type": "every client sets it",
    "content-length": "every client sets it",
    "transfer-encoding": "it is part of the HTTP framing",
    "connection": "it is part of the HTTP framing",
}
MAX_KEYS_PATH_LEN = 4096


def _check_source(value: object) -> str:
    if value not in SOURCES:
        raise _problem(f"must be 'body', 'header' or 'api_key' (got {_shown(value)})")
    return str(value)


def _check_mismatch(value: object) -> str:
    if value not in ON_CLAIM_MISMATCH:
        raise _problem(f"must be 'reject' or 'ignore' (got {_shown(value)})")
    return str(value)


def _check_header_name(value: object) -> str:
    if not isinstance(value, str):
        raise _not_a_string("header name", value)
    if not value:
        raise _problem("must not be empty")
    if len(value) > MAX_NAME_LEN:
        raise _problem(f"header name must be at most {MAX_NAME_LEN} characters (got {len(value)})")
    if not _HEADER_NAME.fullmatch(value):
        allowed = "letters, digits and !#$%&'*+-.^_`|~"
        raise _problem(f"must be an HTTP header name ({allowed}; got {_shown(value)})")
    why = _NOT_IDENTITY_HEADERS.get(value.lower())
    if why is not None:
        raise _problem(f"cannot be {value.lower()!r}: {why}")
    return value


def _check_keys_path(value: object) -> str:
    if not isinstance(value, str):
        raise _not_a_string("keys", value)
    if not value:
        raise _problem("must not be empty")
    if len(value) > MAX_KEYS_PATH_LEN or "\x00" in value:
        raise _problem(f"must be a file path (at most {MAX_KEYS_PATH_LEN} characters, no NUL)")
    return value


_ONLY_WITH = "only read with 'source: {}' (the source here is '{}'); remove it"


class IdentitySection(_Strict):
    """Where the user id of a request comes from, and what a body claim may do.

    `source` is declared first so the checks of the other keys can see it.
    """

    source: Annotated[
        str, PlainValidator(_check_source), WithJsonSchema({"enum": list(SOURCES)})
    ] = Field(
        default="body",
        description="body: vllm_xargs.output_rate_user as the client sent it (anyone who "
        "reaches the port can claim any id); header: the header a trusted gateway sets; "
        "api_key: Authorization: Bearer KEY, looked up in the keys file.",
    )
    header: Annotated[
        str | None,
        PlainValidator(_check_header_name),
        WithJsonSchema({"type": "string", "pattern": _HEADER_NAME.pattern}),
    ] = Field(
        default=None,
        validate_default=True,
        description="With source header: the name of the header the gateway sets "
        "(e.g. x-gateway-inference-fairness-id).",
    )
    keys: Annotated[
        str | None,
        PlainValidator(_check_keys_path),
        WithJsonSchema({"type": "string", "minLength": 1}),
    ] = Field(
        default=None,
        validate_default=True,
        description="With source api_key: the keys file (sha256:<hex>: user id), relative "
        "to this policy file. Manage it with `outrate keys add/revoke`.",
    )
    on_claim_mismatch: Annotated[
        str | None,
        PlainValidator(_check_mismatch),
        WithJsonSchema({"enum": list(ON_CLAIM_MISMATCH)}),
    ] = Field(
        default=None,
        validate_default=True,
        description="With source header or api_key, when the body also names a user and "
        "it is another one: reject (HTTP 403, the default) or ignore the claim.",
    )

    @field_validator("header", "keys", "on_claim_mismatch", mode="wrap")
    @classmethod
    def _fits_the_source(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        """Each key is required by one source and meaningless for the others."""
        source = info.data.get("source")
        wanted = {"header": "header", "keys": "api_key"}.get(info.field_name or "")
        if value is None:
            if source is not None and source == wanted:
                need = (
                    "the name of the header your gateway sets"
                    if wanted == "header"
                    else "the keys file (sha256:<hex>: user id)"
                )
                raise _problem(f"missing; 'source: {source}' needs '{info.field_name}': {need}")
            return None
        checked = handler(value)
        if source is None:
            return checked
        if wanted is not None and source != wanted:
            raise _problem(_ONLY_WITH.format(wanted, source))
        if wanted is None and source == "body":
            raise _problem(
                "only read with 'source: header' or 'source: api_key' (with source body "
                "the claim is the identity); remove it"
            )
        return checked


class Policy(_Strict):
    """A whole policy file. `default` is required so nobody's limit depends on an
    omitted key; `anonymous` falls back to one shared bucket at the default."""

    version: Annotated[int, PlainValidator(_check_version), WithJsonSchema({"const": 1})] = Field(
        description="Format version; must be 1."
    )
    default: LimitSpec = Field(
        description="Limit of identified users not listed in users nor matched by a pattern."
    )
    anonymous: LimitSpec | None = Field(
        default=None,
        description=f"The one budget shared by all requests without a user id "
        f"('{ANONYMOUS}'). Default: the default limit.",
    )
    burst: Duration = Field(
        default=DEFAULT_BURST_NS,
        description="Default burst of every rule that sets none (default 100ms).",
    )
    mode: Annotated[
        str,
        PlainValidator(_check_mode),
        WithJsonSchema({"enum": list(MODES)}),
    ] = Field(
        default="enforce",
        description="shadow: every limit is computed and counted but none is enforced "
        "(a rule's own 'shadow' still wins). Switch to enforce with an edit: hot reload.",
    )
    metrics: MetricsSection = Field(
        default_factory=MetricsSection, description="Per-user series on /metrics."
    )
    identity: IdentitySection = Field(
        default_factory=IdentitySection,
        description="Where the user id comes from: the body (default), a gateway's "
        "header, or API keys. Hot-reloaded like the rest.",
    )
    tiers: dict[Name, TierSpec] = Field(
        default_factory=dict, description="Named limits that users and patterns refer to."
    )
    users: dict[UserId, LimitSpec] = Field(
        default_factory=dict, description="Exact user ids; checked before patterns."
    )
    match: tuple[MatchRule, ...] = Field(
        default=(), description="Ordered globs over user ids; the first match wins."
    )

    # Where each value was written ((field path) -> (line, col)), filled by
    # the loader so lint findings can point into the file. Not part of equality.
    _positions: dict[tuple[str | int, ...], tuple[int, int]] = PrivateAttr(default_factory=dict)
    _source: str = PrivateAttr(default="")

    @model_validator(mode="after")
    def _tiers_exist(self, info: ValidationInfo) -> Policy:
        """The loader reports these with positions first; this guards direct use."""
        if info.context and info.context.get("tiers_checked"):
            return self
        for path, rule in self.rules():
            if isinstance(rule, LimitRule) and rule.tier is not None:
                if rule.tier not in self.tiers:
                    where = ".".join(str(p) for p in path)
                    raise _problem(f"{where}.tier: {unknown_tier(rule.tier, self.tiers)}")
        return self

    def __eq__(self, other: object) -> bool:
        """Same content is the same policy, wherever (and whether) it was read."""
        if not isinstance(other, Policy):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = _Strict.__hash__

    def rules(self) -> list[tuple[FieldPath, TierRule | LimitRule]]:
        """Every limit spec with its field path, e.g. `("users", "alice")`."""
        out: list[tuple[FieldPath, TierRule | LimitRule]] = [(("default",), self.default)]
        if self.anonymous is not None:
            out.append((("anonymous",), self.anonymous))
        out += [(("tiers", name), rule) for name, rule in self.tiers.items()]
        out += [(("users", uid), rule) for uid, rule in self.users.items()]
        out += [(("match", i), rule) for i, rule in enumerate(self.match)]
        return out

    def position(self, *path: str | int) -> tuple[int, int] | None:
        """(line, col) where `path` was written, if this policy came from a file."""
        return self._positions.get(tuple(path))

    @property
    def source(self) -> str:
        return self._source


def unknown_tier(name: str, tiers: Any) -> str:
    """The message for a reference to a tier that is not defined."""
    names = sorted(str(t) for t in tiers)
    if not names:
        return f"unknown tier '{name}' (no tiers are defined)"
    return f"unknown tier '{name}' (defined tiers: {', '.join(names)})"


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema editors use (yaml-language-server), from the models."""
    schema = Policy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "outrate policy"
    return schema
