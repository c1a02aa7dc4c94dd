"""The policy's `metrics:` and `identity:` sections, and the cap on patterns.

Separate from the limit specs (`outrate.policy.specs`) and the top-level
`Policy` (`outrate.policy.model`): each section is its own model with its own
rules (bounded Prometheus cardinality; where a user id comes from and which
header may carry it), so a new section is a new model here and one new field
of `Policy`, without touching how limits are written.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    Field,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from outrate.identity.core import ON_CLAIM_MISMATCH, SOURCES
from outrate.policy.specs import Strict
from outrate.policy.values import MAX_NAME_LEN, Name, not_a_string, problem, shown

MAX_PATTERNS = 1000
"""Patterns in `match:` (and `metrics.per_user`). A user id no exact entry names
is tried against them in order, in the engine's scheduler thread, when its
first request arrives (then cached): about 0.1 ms per 1,000 patterns here, and
`outrate lint` compares them pairwise. Many individual users belong under
`users:`, many users with one limit under a tier."""


def check_pattern_count(n: int) -> None:
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


class MetricsSection(Strict):
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
        check_pattern_count(len(value))
        return value

    max_series: Annotated[
        int, PlainValidator(_check_max_series), WithJsonSchema({"type": "integer", "minimum": 0})
    ] = Field(
        default=1000,
        description="At most this many per_user series (users listed in the policy always "
        "have theirs); past it, those users are counted under limit=other.",
    )


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


class IdentitySection(Strict):
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
