"""One rule set for every identity, in requests and in policies."""

from __future__ import annotations

import hashlib
import hmac
import logging
import sys
import unicodedata
from types import SimpleNamespace

import pytest

from outrate.identity.core import (
    ANONYMOUS,
    STAMP_KEY,
    KeyTable,
    Stamper,
    identity_error,
    key_digest,
    padding_error,
    resolve_identity,
    text_error,
)

F = "vllm_xargs.output_rate_user"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("alice", None),
        ("team-x/bob@example.com", None),
        ("ü" * 256, None),
        ("Zoë Müller", None),  # a plain space and accents are fine
        ("名前", None),
        ("", f"{F} must not be empty"),
        ("x" * 257, f"{F} must be at most 256 characters, got 257"),
        ("a\nb", f"{F} must not contain control characters (U+000A at index 1)"),
        ("a\x7f", f"{F} must not contain control characters (U+007F at index 1)"),
        ("a\x85b", f"{F} must not contain control characters (U+0085 at index 1)"),
        ("a\x9bb", f"{F} must not contain control characters (U+009B at index 1)"),
        ("evil\u202eexe", f"{F} must not contain format characters (U+202E at index 4)"),
        ("ali\u200bce", f"{F} must not contain format characters (U+200B at index 3)"),
        ("\ufeffalice", f"{F} must not contain format characters (U+FEFF at index 0)"),
        ("a\u2028b", f"{F} must not contain line separators (U+2028 at index 1)"),
        ("a\u2029b", f"{F} must not contain paragraph separators (U+2029 at index 1)"),
        ("a\ud800b", f"{F} must not contain surrogates (U+D800 at index 1)"),
        ("alice ", f"{F} must not begin or end with whitespace (U+0020 at index 5)"),
        ("\talice", f"{F} must not contain control characters (U+0009 at index 0)"),
        ("alice\u00a0", f"{F} must not begin or end with whitespace (U+00A0 at index 5)"),
        ("\u3000alice", f"{F} must not begin or end with whitespace (U+3000 at index 0)"),
        ("a\u00a0b", None),  # inside an id a space of any kind is fine, as in "Zoë Müller"
        (ANONYMOUS, f"{F} must not be the reserved id '__anonymous__'"),
        (5, f"{F} must be a string, got number"),
        (1.5, f"{F} must be a string, got number"),
        (True, f"{F} must be a string, got boolean"),
        (None, f"{F} must be a string, got null"),
        (["a"], f"{F} must be a string, got array"),
        ({"a": 1}, f"{F} must be a string, got object"),
    ],
)
def test_identity_error(value: object, error: str | None) -> None:
    assert identity_error(value) == error


def test_the_field_is_named_as_the_request_carried_it() -> None:
    field = "sampling_params.extra_args.output_rate_user"
    assert identity_error("", field) == f"{field} must not be empty"


def test_text_error_checks_every_character() -> None:
    assert text_error("a" * 100 + "\u200b") == (
        "must not contain format characters (U+200B at index 100)"
    )
    assert text_error("ok") is None


def test_padding_error_refuses_every_unicode_space_at_either_end() -> None:
    """Zs (NBSP, EN QUAD ... HAIR SPACE, NARROW NBSP, IDEOGRAPHIC SPACE) and
    the ASCII blanks: each at either end is named; inside an id it is fine."""
    spaces = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Zs"]
    assert len(spaces) == 17 and "\u00a0" in spaces and "\u3000" in spaces
    for c in [*spaces, "\t", "\n", "\r", "\x0b", "\x0c"]:
        at = f"must not begin or end with whitespace (U+{ord(c):04X} at index"
        assert padding_error(c + "bob") == f"{at} 0)"
        assert padding_error("bob" + c) == f"{at} 3)"
        assert padding_error("b" + c + "b") is None
    assert padding_error("") is None and padding_error("bob") is None
    assert padding_error("\u200bbob") is None  # Cf, not whitespace: text_error refuses it


def test_the_engine_counts_an_invisible_identity_as_anonymous(
    caplog: pytest.LogCaptureFixture,
) -> None:
    params = SimpleNamespace(extra_args={"output_rate_user": "ali\u200bce"})
    logger = logging.getLogger("test.identity")
    with caplog.at_level(logging.WARNING, logger="test.identity"):
        assert resolve_identity(params, logger) == ANONYMOUS
    assert caplog.messages == [
        f"outrate: {F} must not contain format characters (U+200B at index 3); "
        "request counted in the anonymous budget"
    ]
    caplog.clear()
    params = SimpleNamespace(extra_args={"output_rate_user": "alice\u00a0"})
    with caplog.at_level(logging.WARNING, logger="test.identity"):
        assert resolve_identity(params, logger) == ANONYMOUS  # never a second alice
    assert caplog.messages == [
        f"outrate: {F} must not begin or end with whitespace (U+00A0 at index 5); "
        "request counted in the anonymous budget"
    ]


# -- API keys: looked up by digest, in constant time ------------------------------


def _table(n: int) -> tuple[KeyTable, list[str]]:
    keys = [f"ork_key-{i:04d}" for i in range(n)]
    entries = [(hashlib.sha256(k.encode()).digest(), f"user-{i}") for i, k in enumerate(keys)]
    return KeyTable(entries), keys


@pytest.mark.parametrize("n", [1, 7, 200])
def test_lookup_compares_the_digest_with_every_entry_whatever_matches(monkeypatch, n) -> None:
    """The timing guarantee as a mechanism: the presented key is hashed, and its
    digest goes through hmac.compare_digest against *every* entry, the same
    number of times for the first entry, the last one, a near miss (all but
    the last character of a real key) and garbage. Never a plain comparison,
    never the key itself, never an early exit."""
    table, keys = _table(n)
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("outrate.identity.core.hmac.compare_digest", compare_digest)
    presented = [keys[0], keys[-1], keys[-1][:-1] + "X", "nothing like it", "x" * 1000]
    answers = []
    for key in presented:
        calls.clear()
        answers.append(table.lookup(key.encode()))
        digest = hashlib.sha256(key.encode()).digest()
        assert len(calls) == n
        assert all(len(a) == len(b) == 32 for a, b in calls)
        assert all(key.encode() not in (a, b) for a, b in calls)
        assert {b for _, b in calls} == {digest}
    assert answers == ["user-0", f"user-{n - 1}", None, None, None]


def test_a_digest_is_what_the_keys_file_stores() -> None:
    assert key_digest("abc") == "sha256:" + hashlib.sha256(b"abc").hexdigest()


# -- the API server's signature, and what the engine trusts ---------------------


def test_a_stamp_carries_the_user_and_cannot_be_forged() -> None:
    stamper = Stamper(b"k" * 32)
    stamp = stamper.sign("alice")
    assert stamper.verify(stamp) == "alice"
    mac, _, _ = stamp.partition(":")
    assert stamper.verify(f"{mac}:bob") is None  # alice's MAC on bob
    assert Stamper(b"o" * 32).verify(stamp) is None  # another server's secret
    for junk in (None, 5, "", "alice", ":alice", "zz:alice", "\u00e9:x", ["a"]):
        assert stamper.verify(junk) is None
    assert repr(stamper) == "Stamper(<secret>)"
    assert Stamper.from_env({}) is None
    assert Stamper.from_env({"OUTRATE_IDENTITY_SECRET": "not hex"}) is None
    assert Stamper.from_env({"OUTRATE_IDENTITY_SECRET": "ab" * 32}) is not None
    with pytest.raises(ValueError):
        Stamper(b"short")


@pytest.mark.parametrize("source", ["header", "api_key"])
def test_without_a_body_source_the_engine_trusts_only_the_stamp(caplog, source: str) -> None:
    stamper = Stamper(b"s" * 32)
    logger = logging.getLogger("test.identity")

    def resolve(extra: dict) -> str:
        return resolve_identity(SimpleNamespace(extra_args=extra), logger, source, stamper)

    with caplog.at_level(logging.WARNING, logger="test.identity"):
        assert resolve({"output_rate_user": "bob"}) == ANONYMOUS  # a body claim: never
        assert resolve({STAMP_KEY: Stamper(b"x" * 32).sign("bob")}) == ANONYMOUS
        assert resolve({STAMP_KEY: stamper.sign("alice"), "output_rate_user": "bob"}) == "alice"
        assert resolve({}) == ANONYMOUS
    assert len(caplog.messages) == 2
    assert caplog.messages[0] == (
        f"outrate: identity.source is {source} and this request carries no identity "
        "verified by the API server; request counted in the anonymous budget"
    )
    no_secret = SimpleNamespace(extra_args={STAMP_KEY: stamper.sign("alice")})
    assert resolve_identity(no_secret, None, source, None) == ANONYMOUS


def test_with_the_body_source_the_claim_counts_as_before() -> None:
    params = SimpleNamespace(extra_args={"output_rate_user": "bob"})
    assert resolve_identity(params, None, "body", Stamper(b"s" * 32)) == "bob"
