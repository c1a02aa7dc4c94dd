"""One rule set for every identity, in requests and in policies."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from outrate.identity import ANONYMOUS, identity_error, resolve_identity, text_error

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
