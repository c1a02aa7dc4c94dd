"""The policy file format as pydantic models: the top-level `Policy`.

These models are the one definition of what a policy may say: the loader
validates against them, `outrate schema` exports them for editors, and the
compiler trusts what they accept. So every value rule lives in them, with the
short human message a file author sees; the loader only adds the file and line.

Layout rules that keep the format growable: every model forbids unknown keys
(a typo is an error, not a silently ignored limit), and each section is its own
field of `Policy`, so a future `shadow:` or `metrics:` section is one new field.
The limit specs are `outrate.policy.specs`, the other sections
`outrate.policy.sections`; this module joins them, and is where callers import
them from.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from outrate.identity.core import ANONYMOUS
from outrate.policy.sections import (
    MAX_PATTERNS,
    IdentitySection,
    MetricsSection,
    check_pattern_count,
)
from outrate.policy.specs import (
    FieldPath,
    LimitRule,
    LimitSpec,
    MatchRule,
    Strict,
    TierRule,
    TierSpec,
    peak_problem,
)
from outrate.policy.values import (
    DEFAULT_BURST_NS,
    Duration,
    Name,
    UserId,
    check_version,
    problem,
    shown,
)

__all__ = [
    "HEADER_STYLES",
    "MAX_PATTERNS",
    "MODES",
    "FieldPath",
    "IdentitySection",
    "LimitRule",
    "MatchRule",
    "MetricsSection",
    "Policy",
    "TierRule",
    "policy_json_schema",
    "unknown_tier",
]

MODES = ("enforce", "shadow")
HEADER_STYLES = ("both", "ietf", "openai", "off")
"""`headers:`: which rate-limit fields every guarded response carries
(docs/client-contract.md). `both` is the default: OpenAI-compatible clients
read `x-ratelimit-*`, and generic HTTP tooling reads the IETF draft's
`RateLimit-Policy` / `RateLimit`; the two sets do not collide."""


def _check_mode(value: object) -> str:
    if value not in MODES:
        raise problem(f"must be 'enforce' or 'shadow' (got {shown(value)})")
    return str(value)


def _check_headers(value: object) -> str:
    """`headers: off` is YAML 1.1's `false`: it means what it says."""
    if value is False:
        return "off"
    if isinstance(value, bool) or value not in HEADER_STYLES:
        raise problem(f"must be 'both', 'ietf', 'openai' or 'off' (got {shown(value)})")
    return str(value)


class Policy(Strict):
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
    headers: Annotated[
        str,
        PlainValidator(_check_headers),
        WithJsonSchema({"enum": [*HEADER_STYLES, False]}),
    ] = Field(
        default="both",
        description="Rate-limit header fields on every guarded response: ietf "
        "(RateLimit-Policy, RateLimit), openai (x-ratelimit-*), both (default) or off.",
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
        check_pattern_count(len(value))
        return value

    @model_validator(mode="after")
    def _tiers_exist(self, info: ValidationInfo) -> Policy:
        """Tier references exist, and a `peak` beside one is not below the tier's
        rate. The loader reports these with positions first; this guards direct use."""
        if info.context and info.context.get("tiers_checked"):
            return self
        for path, rule in self.rules():
            if isinstance(rule, LimitRule) and rule.tier is not None:
                where = ".".join(str(p) for p in path)
                if rule.tier not in self.tiers:
                    raise problem(f"{where}.tier: {unknown_tier(rule.tier, self.tiers)}")
                if rule.peak is not None:
                    bad = peak_problem(self.tiers[rule.tier].rate, rule.peak, rule.tier)
                    if bad is not None:
                        raise problem(f"{where}.peak: {bad}")
        return self

    def __eq__(self, other: object) -> bool:
        """Same content is the same policy, wherever (and whether) it was read."""
        if not isinstance(other, Policy):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = Strict.__hash__

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
