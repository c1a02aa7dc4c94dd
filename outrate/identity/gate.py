"""The API server's decision, once per request: who is asking, and may it go on.

Pure functions over what an ASGI server hands over (header pairs as bytes, the
request body's identity claims), so every rule is unit-tested without a
server. `vllm_integration/apiserver/guards.py` calls them from its middleware and turns a
refusal into vLLM's error response.

Order of checks, so an unauthenticated client learns nothing else:

1. `authenticate`: `api_key` -> a usable `Authorization: Bearer KEY` whose
   digest is in the keys file (else 401); `header` -> the gateway's header,
   valid under the identity rules (else 400), or anonymous when absent;
   `body` -> nothing to check yet.
2. `check_claims`: a claim in the body (`vllm_xargs.output_rate_user`, or
   `sampling_params.extra_args.output_rate_user` on the token-in route) must
   follow the identity rules (else 400). With `body` it is the identity; with
   the other sources a claim naming anyone but the authenticated user is
   refused (403, `on_claim_mismatch: reject`) or dropped (`ignore`).

Keys never appear in a message, a log line or an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import NamedTuple

from outrate.identity.core import IDENTITY_KEY, IdentityConfig, identity_error

EXEMPT_PATHS = frozenset({"/health", "/ping", "/metrics", "/v1/models"})
"""Routes that never reach the engine and that probes and scrapers call
without credentials: no identity is asked for there. Every other route is
guarded (default deny), so a route vLLM adds later is covered too."""

MAX_AUTHORIZATION_BYTES = 1024
"""A Bearer key is ~50 characters; anything this long is not one of ours and
is refused before it is hashed."""

_TOKEN68 = re.compile(rb"[A-Za-z0-9\-._~+/]+=*")
"""RFC 6750's b64token: the characters a Bearer credential may have."""

_OWS = b" \t"
"""Optional whitespace around a field value (RFC 9110 section 5.5), not part of
it. Stripped here: h11 drops it, but uvicorn's httptools parser keeps
trailing whitespace, and `alice   ` would be charged as a new user."""

_AUTHORIZATION = b"authorization"
_KEY = IDENTITY_KEY.encode()


class Verdict(NamedTuple):
    """`status` 200: go on, charging `user` (None: the anonymous budget);
    400, 401 or 403: refuse with `message` (and `parameter`, the field)."""

    status: int
    user: str | None = None
    message: str = ""
    parameter: str | None = None


GO_ON = Verdict(200)

Claim = tuple[str, object]
"""(field, value) of an identity the body names."""


def is_exempt(method: str | None, path: str) -> bool:
    """CORS preflights and the probe/scrape/metadata routes."""
    return method == "OPTIONS" or path in EXEMPT_PATHS


def _values(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for key, value in headers if key.lower() == name]


def bearer_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | str:
    """The key of `Authorization: Bearer KEY`, or why there is none (a message
    that never quotes what was sent)."""
    values = _values(headers, _AUTHORIZATION)
    if not values:
        return "missing API key: send 'Authorization: Bearer <key>'"
    if len(values) > 1:
        return "malformed Authorization header: sent more than once"
    value = values[0]
    if len(value) > MAX_AUTHORIZATION_BYTES:
        return f"malformed Authorization header: longer than {MAX_AUTHORIZATION_BYTES} bytes"
    scheme, _, key = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return "malformed Authorization header: expected 'Bearer <key>'"
    key = key.strip(b" ")
    if not _TOKEN68.fullmatch(key):
        return "malformed Authorization header: expected 'Bearer <key>'"
    return key


def authenticate(identity: IdentityConfig, headers: Iterable[tuple[bytes, bytes]]) -> Verdict:
    """Step 1: the identity the request's credentials or gateway header carry."""
    if identity.source == "api_key":
        key = bearer_key(headers)
        if isinstance(key, str):
            return Verdict(401, message=key)
        user = identity.keys.lookup(key) if identity.keys is not None else None
        if user is None:
            return Verdict(401, message="invalid API key")
        return Verdict(200, user)
    if identity.source == "header" and identity.header:
        values = _values(headers, identity.header.encode("latin-1"))
        if not values:
            return GO_ON  # no header: the anonymous budget
        field = f"header {identity.header}"
        if len(values) > 1:
            return Verdict(400, message=f"{field} must be sent once", parameter=field)
        try:
            text = values[0].strip(_OWS).decode("utf-8")
        except UnicodeDecodeError:
            return Verdict(400, message=f"{field} must be UTF-8 text", parameter=field)
        error = identity_error(text, field)  # other whitespace at an end is a 400
        if error is not None:
            return Verdict(400, message=error, parameter=field)
        return Verdict(200, text)
    return GO_ON


def check_claims(identity: IdentityConfig, verdict: Verdict, claims: list[Claim]) -> Verdict:
    """Step 2: the body's claims against the rules and against step 1."""
    for field, value in claims:
        error = identity_error(value, field)
        if error is not None:
            return Verdict(400, message=error, parameter=field)
    if identity.source == "body":
        return GO_ON  # the claim is the identity; it travels in the request as sent
    for field, value in claims:
        if value == verdict.user or identity.on_claim_mismatch == "ignore":
            continue
        if identity.source == "api_key":
            whose = "the user this API key identifies"
        elif verdict.user is None:
            whose = f"anyone: the request has no {identity.header} header"
        else:
            whose = f"the user the {identity.header} header identifies"
        return Verdict(
            403,
            message=f"{field} names {value!r}, not {whose}; leave it out "
            "(identity.on_claim_mismatch: reject)",
            parameter=field,
        )
    return verdict


def body_claims(body: bytes) -> list[Claim]:
    """The identities a JSON body names, where vLLM's routes read them:
    `vllm_xargs` (OpenAI, Anthropic, SageMaker routes) and `sampling_params.
    extra_args` (`/inference/v1/generate`). Bodies that do not parse are left
    to vLLM, which answers them itself."""
    if _KEY not in body and b"\\u" not in body:  # the key can be \\u-escaped
        return []
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return []
    if not isinstance(data, dict):
        return []
    params = data.get("sampling_params")
    places = [("vllm_xargs", data.get("vllm_xargs"))]
    if isinstance(params, dict):
        places.append(("sampling_params.extra_args", params.get("extra_args")))
    return [
        (f"{name}.{IDENTITY_KEY}", args[IDENTITY_KEY])
        for name, args in places
        if isinstance(args, dict) and IDENTITY_KEY in args
    ]
