"""The API server's per-request identity decision (outrate.identity.gate), without a server."""

from __future__ import annotations

import json

import pytest

from outrate.identity.core import BODY, IdentityConfig, KeyTable, key_digest
from outrate.identity.gate import (
    MAX_AUTHORIZATION_BYTES,
    Verdict,
    authenticate,
    bearer_key,
    body_claims,
    check_claims,
    is_exempt,
)

KEY = "ork_alices-key"
TABLE = KeyTable([(bytes.fromhex(key_digest(KEY)[7:]), "alice")])
API_KEY = IdentityConfig(source="api_key", keys=TABLE)
API_KEY_IGNORE = IdentityConfig(source="api_key", keys=TABLE, on_claim_mismatch="ignore")
HEADER = IdentityConfig(source="header", header="x-outrate-user")
HEADER_IGNORE = IdentityConfig(source="header", header="x-outrate-user", on_claim_mismatch="ignore")
X = "vllm_xargs.output_rate_user"


def auth(value: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"authorization", value)]


MALFORMED = {
    "empty": auth(b""),
    "scheme only": auth(b"Bearer"),
    "scheme and blank": auth(b"Bearer   "),
    "basic": auth(b"Basic YWxpY2U6c2VjcmV0"),
    "no scheme": auth(KEY.encode()),
    "two keys": auth(b"Bearer a b"),
    "not a b64token": auth(b"Bearer ork_\xff\x00"),
    "10 KB": auth(b"Bearer " + b"k" * 10_240),
    "twice": [(b"authorization", b"Bearer " + KEY.encode())] * 2,
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_authorization_header_is_401(case: str) -> None:
    verdict = authenticate(API_KEY, MALFORMED[case])
    assert verdict.status == 401 and verdict.user is None
    assert verdict.message.startswith("malformed Authorization header: ")
    assert KEY not in verdict.message and "YWxp" not in verdict.message


def test_the_key_decides_the_user() -> None:
    assert authenticate(API_KEY, auth(b"Bearer " + KEY.encode())) == Verdict(200, "alice")
    assert authenticate(API_KEY, auth(b"bearer  " + KEY.encode())) == Verdict(200, "alice")
    assert authenticate(API_KEY, []) == Verdict(
        401, message="missing API key: send 'Authorization: Bearer <key>'"
    )
    assert authenticate(API_KEY, auth(b"Bearer ork_other")) == Verdict(
        401, message="invalid API key"
    )
    unloaded = IdentityConfig(source="api_key", keys=None)
    assert authenticate(unloaded, auth(b"Bearer " + KEY.encode())).status == 401
    assert bearer_key(auth(b"Bearer " + b"k" * (MAX_AUTHORIZATION_BYTES - 7))) == b"k" * 1017


def test_the_gateway_header_names_the_user() -> None:
    assert authenticate(HEADER, [(b"x-outrate-user", b"carol")]) == Verdict(200, "carol")
    assert authenticate(HEADER, [(b"x-outrate-user", "Zoë".encode())]) == Verdict(200, "Zoë")
    assert authenticate(HEADER, []) == Verdict(200, None)  # the anonymous budget
    f = "header x-outrate-user"
    assert authenticate(HEADER, [(b"x-outrate-user", b"")]) == Verdict(
        400, message=f"{f} must not be empty", parameter=f
    )
    assert authenticate(HEADER, [(b"x-outrate-user", b"a\x1bb")]).message == (
        f"{f} must not contain control characters (U+001B at index 1)"
    )
    assert authenticate(HEADER, [(b"x-outrate-user", b"x" * 257)]).status == 400
    assert authenticate(HEADER, [(b"x-outrate-user", b"__anonymous__")]).status == 400
    assert authenticate(HEADER, [(b"x-outrate-user", b"\xff")]).message == (
        f"{f} must be UTF-8 text"
    )
    assert authenticate(HEADER, [(b"x-outrate-user", b"a"), (b"x-outrate-user", b"b")]) == (
        Verdict(400, message=f"{f} must be sent once", parameter=f)
    )
    # the body source reads no header at all
    assert authenticate(BODY, [(b"x-outrate-user", b"carol")]) == Verdict(200, None)


def test_a_gateway_header_loses_its_optional_whitespace_and_nothing_else() -> None:
    """RFC 9110 section 5.5: SP and HTAB around a field value are not part of
    it (uvicorn's httptools parser keeps trailing ones). Any other whitespace
    left at an end, NBSP included, is refused: never a second alice."""
    f = "header x-outrate-user"
    for sent in (b"alice   ", b"  alice", b"\talice \t", b"alice\t"):
        assert authenticate(HEADER, [(b"x-outrate-user", sent)]) == Verdict(200, "alice"), sent
    assert authenticate(HEADER, [(b"x-outrate-user", b"Zo\xc3\xab M\xc3\xbcller ")]) == (
        Verdict(200, "Zoë Müller")
    )
    assert authenticate(HEADER, [(b"x-outrate-user", b" \t ")]) == Verdict(
        400, message=f"{f} must not be empty", parameter=f
    )
    nbsp = "alice\u00a0".encode()  # UTF-8, as the gate decodes every header
    assert authenticate(HEADER, [(b"x-outrate-user", nbsp)]) == Verdict(
        400, message=f"{f} must not begin or end with whitespace (U+00A0 at index 5)",
        parameter=f,
    )  # fmt: skip
    assert authenticate(HEADER, [(b"x-outrate-user", "alice\u00a0 ".encode())]).status == 400
    assert authenticate(HEADER, [(b"x-outrate-user", "\u3000alice".encode())]).status == 400
    assert authenticate(HEADER, [(b"x-outrate-user", b"alice\xa0")]) == Verdict(
        400, message=f"{f} must be UTF-8 text", parameter=f
    )  # latin-1 NBSP: not UTF-8, as any other latin-1 byte


def test_a_claim_of_another_user() -> None:
    alice = Verdict(200, "alice")
    assert check_claims(API_KEY, alice, [(X, "alice")]) == alice
    assert check_claims(API_KEY, alice, []) == alice
    assert check_claims(API_KEY, alice, [(X, "bob")]) == Verdict(
        403,
        message=f"{X} names 'bob', not the user this API key identifies; leave it out "
        "(identity.on_claim_mismatch: reject)",
        parameter=X,
    )
    assert check_claims(API_KEY_IGNORE, alice, [(X, "bob")]) == alice
    assert check_claims(HEADER, Verdict(200, None), [(X, "bob")]).message == (
        f"{X} names 'bob', not anyone: the request has no x-outrate-user header; leave it "
        "out (identity.on_claim_mismatch: reject)"
    )
    assert check_claims(HEADER_IGNORE, Verdict(200, None), [(X, "bob")]) == Verdict(200, None)
    # an invalid claim is 400 whatever the source
    for identity in (BODY, API_KEY, API_KEY_IGNORE, HEADER_IGNORE):
        assert check_claims(identity, alice, [(X, "a\nb")]) == Verdict(
            400, message=f"{X} must not contain control characters (U+000A at index 1)",
            parameter=X,
        )  # fmt: skip
    assert check_claims(BODY, Verdict(200), [(X, "bob")]) == Verdict(200)
    # a body claim is never stripped: whitespace at an end is a 400 from every source
    for identity in (BODY, API_KEY, HEADER):
        assert check_claims(identity, alice, [(X, "alice\u00a0")]) == Verdict(
            400, message=f"{X} must not begin or end with whitespace (U+00A0 at index 5)",
            parameter=X,
        )  # fmt: skip
        assert check_claims(identity, alice, [(X, "alice ")]).status == 400


def test_body_claims_where_vllm_reads_them() -> None:
    def claims(body: object) -> list:
        return body_claims(json.dumps(body).encode())

    assert claims({"vllm_xargs": {"output_rate_user": "bob"}}) == [(X, "bob")]
    generate = {"sampling_params": {"extra_args": {"output_rate_user": 5}}}
    assert claims(generate) == [("sampling_params.extra_args.output_rate_user", 5)]
    assert claims({"prompt": "no claim"}) == []
    assert body_claims(b'{"vllm_xargs": {"output_rate_\\u0075ser": "x"}}') == [(X, "x")]
    assert body_claims(b'{"vllm_xargs": {"output_rate_user": ') == []  # vLLM answers it


def test_probes_and_preflights_need_no_identity() -> None:
    assert is_exempt("GET", "/health") and is_exempt("GET", "/v1/models")
    assert is_exempt("GET", "/metrics") and is_exempt("POST", "/ping")
    assert is_exempt("OPTIONS", "/v1/completions")
    assert not is_exempt("POST", "/v1/completions") and not is_exempt("GET", "/version")
    assert not is_exempt("POST", "/v1/a-route-added-later")
