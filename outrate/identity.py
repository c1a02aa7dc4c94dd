"""Who a request belongs to: `vllm_xargs.output_rate_user`, validated.

The API layer refuses a bad identity with HTTP 400 before it reaches the
engine (`identity_error`); the engine never trusts that happened and maps
anything invalid to the anonymous budget (`resolve_identity`), so a bad value
can neither crash the engine nor escape every limit.

`text_error` is the one rule for the characters of every name a policy or a
request carries (user ids, tier names, patterns): no characters a reader
cannot see. Control characters (Cc) end log lines and spoof terminals; format
characters (Cf: bidi overrides such as U+202E, zero-width marks such as
U+200B) make two different ids look the same; line and paragraph separators
(Zl, Zp) split log lines; lone surrogates (Cs) cannot be encoded at all.
"""

from __future__ import annotations

import logging
import unicodedata
from typing import Any

from outrate.limiter import ANONYMOUS

IDENTITY_KEY = "output_rate_user"
"""The `vllm_xargs` key (and `SamplingParams.extra_args` key) that names the user."""

IDENTITY_FIELD = f"vllm_xargs.{IDENTITY_KEY}"

MAX_IDENTITY_LEN = 256
"""Also the length limit of every name in a policy (user ids, tiers, patterns)."""

_INVISIBLE = {
    "Cc": "control characters",
    "Cf": "format characters",
    "Zl": "line separators",
    "Zp": "paragraph separators",
    "Cs": "surrogates",
}


def text_error(text: str) -> str | None:
    """Why `text` is unfit as a name (`must not contain ...`), or None.

    Names the first offending character by code point, since it is invisible.
    """
    if text.isascii():  # the common case: only C0 controls and DEL are Cc
        for i, c in enumerate(text):
            if c < " " or c == "\x7f":
                return f"must not contain control characters (U+{ord(c):04X} at index {i})"
        return None
    for i, c in enumerate(text):
        what = _INVISIBLE.get(unicodedata.category(c))
        if what is not None:
            return f"must not contain {what} (U+{ord(c):04X} at index {i})"
    return None


def identity_error(value: Any, field: str = IDENTITY_FIELD) -> str | None:
    """Why `value` is not a usable identity, or None when it is.

    `field` names where the request carried it (`sampling_params.extra_args.
    output_rate_user` on vLLM's token-in route)."""
    if not isinstance(value, str):
        return f"{field} must be a string, got {_json_type(value)}"
    if not value:
        return f"{field} must not be empty"
    if len(value) > MAX_IDENTITY_LEN:
        return f"{field} must be at most {MAX_IDENTITY_LEN} characters, got {len(value)}"
    bad = text_error(value)
    if bad is not None:
        return f"{field} {bad}"
    if value == ANONYMOUS:
        return f"{field} must not be the reserved id {ANONYMOUS!r}"
    return None


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, as the client wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def resolve_identity(sampling_params: Any, logger: logging.Logger | None = None) -> str:
    """The user id of a request inside the engine; never raises."""
    extra = getattr(sampling_params, "extra_args", None)
    if not extra:
        return ANONYMOUS
    try:
        value = extra.get(IDENTITY_KEY)
    except AttributeError:
        return ANONYMOUS
    if value is None:
        return ANONYMOUS
    error = identity_error(value)
    if error is None and isinstance(value, str):  # (identity_error said so; for mypy)
        return value
    if logger is not None:
        logger.warning("outrate: %s; request counted in the anonymous budget", error)
    return ANONYMOUS
