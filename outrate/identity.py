"""Who a request belongs to: `vllm_xargs.output_rate_user`, validated.

The API layer refuses a bad identity with HTTP 400 before it reaches the
engine (`identity_error`); the engine never trusts that happened and maps
anything invalid to the anonymous budget (`resolve_identity`), so a bad value
can neither crash the engine nor escape every limit.
"""

from __future__ import annotations

import logging
from typing import Any

from outrate.limiter import ANONYMOUS

IDENTITY_KEY = "output_rate_user"
"""The `vllm_xargs` key (and `SamplingParams.extra_args` key) that names the user."""

MAX_IDENTITY_LEN = 256


def identity_error(value: Any) -> str | None:
    """Why `value` is not a usable identity, or None when it is."""
    field = f"vllm_xargs.{IDENTITY_KEY}"
    if not isinstance(value, str):
        return f"{field} must be a string, got {type(value).__name__}"
    if not value:
        return f"{field} must not be empty"
    if len(value) > MAX_IDENTITY_LEN:
        return f"{field} must be at most {MAX_IDENTITY_LEN} characters, got {len(value)}"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return f"{field} must not contain control characters"
    if value == ANONYMOUS:
        return f"{field} must not be the reserved id {ANONYMOUS!r}"
    return None


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
    if error is None:
        return value
    if logger is not None:
        logger.warning("outrate: %s; request counted in the anonymous budget", error)
    return ANONYMOUS
