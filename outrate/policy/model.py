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

import re
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from outrate.identity.core import (
    ANONYMOUS,
    ON_CLAIM_MISMATCH,
    SOURCES,
)
from outrate.policy.values import (
    DEFAULT_BURST_NS,
    MAX_NAME_LEN,
    RATE_SCHEMA,
    Duration,
    MaxStreams,
    Name,
    Pattern,
    Rate,
    RateValue,
    UserId,
    check_version,
    not_a_string,
    problem,
    shown,
)

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

MODES = ("enforce", "shadow")


def _check_mode(value: object) -> str:
    if value not in MODES:
        raise problem(f"must be 'enforce' or 'shadow' (got {shown(value)})")
    return str(value)


MAX_PATTERNS = 1000
"""Patterns in `match:` (and `metrics.per_user`). A user id no exact entry names
is tried against them in order, in the engine's scheduler thread, when its
first request arrives (then cached): about 0.1 ms per 1,000 patterns here, and
`outrate lint` compares them pairwise. Many individual users belong under
`users:`, many users with one limit under a tier."""


def _check_pattern_count(n: int) -> None:
    if n > MAX_PATTERNS:
        raise problem(
            f"at most {MAX_PATTERNS} patterns (got {n}): list individual users under "
            "'users:' (a tier gives many of them one limit)"
        )


MAX_SERIES_LIMIT = 100_000
"""More per-user series than this is a cardinality problem for any Prometheus."""


def _check_max_series(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise problem(f"must be a whole number (got {shown(value)})")
    if value < 0:
        raise problem("must be >= 0")
    if value > MAX_SERIES_LIMIT:
        raise problem(f"must be at most {MAX_SERIES_LIMIT}")
    return value


class MetricsSection(_Strict):
    """Which users get Prometheus series of their own (bounded cardinality)."""

    per_user: tuple[Name, ...] = Field(
        default=(),
        description="Globs over user ids that get a series of their own (listed users "
        f"always do). Everyone else is counted under the rule that matched them. At most "
        f"{MAX_PATTERNS}.",
    )

    @field_validator("per_user")
    @classmethod
    def _few_patterns(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        _check_pattern_count(len(value))
        return value

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
        raise problem(f"must be 'body', 'header' or 'api_key' (got {shown(value)})")
    return str(value)


def _check_mismatch(value: object) -> str:
    if value not in ON_CLAIM_MISMATCH:
        raise problem(f"must be 'reject' or 'ignore' (got {shown(value)})")
    return str(value)


def _check_header_name(value: object) -> str:
    if not isinstance(value, str):
        raise not_a_string("header name", value)
    if not value:
        raise problem("must not be empty")
    if len(value) > MAX_NAME_LEN:
        raise problem(f"header name must be at most {MAX_NAME_LEN} characters (got {len(value)})")
    if not _HEADER_NAME.fullmatch(value):
        allowed = "letters, digits and !#$%&'*+-.^_`|~"
        raise problem(f"must be an HTTP header name ({allowed}; got {shown(value)})")
    why = _NOT_IDENTITY_HEADERS.get(value.lower())
    if why is not None:
        raise problem(f"cannot be {value.lower()!r}: {why}")
    return value


def _check_keys_path(value: object) -> str:
    if not isinstance(value, str):
        raise not_a_string("keys", value)
    if not value:
        raise problem("must not be empty")
    if len(value) > MAX_KEYS_PATH_LEN or "\x00" in value:
        raise problem(f"must be a file path (at most {MAX_KEYS_PATH_LEN} characters, no NUL)")
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
                raise problem(f"missing; 'source: {source}' needs '{info.field_name}': {need}")
            return None
        checked = handler(value)
        if source is None:
            return checked
        if wanted is not None and source != wanted:
            raise problem(_ONLY_WITH.format(wanted, source))
        if wanted is None and source == "body":
            raise problem(
                "only read with 'source: header' or 'source: api_key' (with source body "
                "the claim is the identity); remove it"
            )
        return checked


class Policy(_Strict):
    """A whole policy file. `default` is required so nobody's limit depends on an
    omitted key; `anonymous` falls back to one shared bucket at the default."""

    version: Annotated[int, PlainValidator(check_version), WithJsonSchema({"const": 1})] = Field(
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
        default=(),
        description=f"Ordered globs over user ids; the first match wins. At most {MAX_PATTERNS}.",
    )

    # Where each value was written ((field path) -> (line, col)), filled by
    # the loader so lint findings can point into the file. Not part of equality.
    _positions: dict[tuple[str | int, ...], tuple[int, int]] = PrivateAttr(default_factory=dict)
    _source: str = PrivateAttr(default="")

    @field_validator("match")
    @classmethod
    def _few_patterns(cls, value: tuple[MatchRule, ...]) -> tuple[MatchRule, ...]:
        _check_pattern_count(len(value))
        return value

    @model_validator(mode="after")
    def _tiers_exist(self, info: ValidationInfo) -> Policy:
        """The loader reports these with positions first; this guards direct use."""
        if info.context and info.context.get("tiers_checked"):
            return self
        for path, rule in self.rules():
            if isinstance(rule, LimitRule) and rule.tier is not None:
                if rule.tier not in self.tiers:
                    where = ".".join(str(p) for p in path)
                    raise problem(f"{where}.tier: {unknown_tier(rule.tier, self.tiers)}")
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
