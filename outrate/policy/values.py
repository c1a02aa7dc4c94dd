"""The scalar values of the policy format: rates, durations, stream caps,
user ids, tier names and patterns, the version. Each has one parser with the
short human message a file author sees (`(got ...)` shows the value as it was
written); the models in policy.py compose them into sections.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import PlainSerializer, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from outrate.budget.limiter import NS_PER_S, exact_rate
from outrate.identity.core import ANONYMOUS, MAX_IDENTITY_LEN, padding_error, text_error
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


def problem(message: str) -> PydanticCustomError:
    """Our own error type, so the loader can show `message` as it is."""
    return PydanticCustomError("outrate", message)


def shown(value: object) -> str:
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
_QUOTED_NUMBER = re.compile(r"\s*([-+]?(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][-+]?\d+)?)\s*")
"""A number written in quotes (`peak: "200"`): a rate means the same quoted or
not, as `"2/3"` and `"unlimited"` always did (JSON has no other way to write
those two). Underscores between digits too (`"1_000"`), as YAML reads
`1_000` unquoted (outrate.policy.scalars)."""
_RATE_EXPECTED = "must be a number of tokens per second or 'unlimited'"
_TOO_FAST = f"must be at most {MAX_RATE} tokens per second (use 'unlimited' for no limit)"
_TOO_SLOW = "must be at least 0.000001 tokens per second (one token in about 12 days)"
_MIN_RATE_DECIMAL = Decimal(MIN_RATE.numerator) / Decimal(MIN_RATE.denominator)


def parse_rate(value: object) -> RateValue:
    """A rate exactly as written: 0.1 stays 1/10 so pacing never drifts."""
    if isinstance(value, Fraction):  # from code, not YAML: the same digit cap as 'n/d'
        digits = max(len(str(value.numerator)), len(str(value.denominator)))
        if digits > MAX_RATE_DIGITS:
            raise problem(f"must have at most {MAX_RATE_DIGITS} digits (got {digits})")
        rate = value
    elif isinstance(value, bool) or value is None:
        raise problem(f"{_RATE_EXPECTED} (got {shown(value)})")
    elif isinstance(value, int | Decimal | float):
        if not (value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)):
            raise problem(
                f"must be a finite number; use 'unlimited' for no limit (got {shown(value)})"
            )
        _check_magnitude(value)  # before exact_rate: 1e-999999999 is a billion-digit Fraction
        rate = exact_rate(value)
    elif isinstance(value, str):
        if value == UNLIMITED:
            return UNLIMITED
        number = _QUOTED_NUMBER.fullmatch(value)
        if number is not None:
            return parse_rate(Decimal(number.group(1).replace("_", "")))
        m = _FRACTION.fullmatch(value)
        if m is None:
            raise problem(f"{_RATE_EXPECTED} (got {shown(value)})")
        digits = max(len(m.group(1)), len(m.group(2)))
        if digits > MAX_RATE_DIGITS:
            raise problem(f"must have at most {MAX_RATE_DIGITS} digits (got {digits})")
        if int(m.group(2)) == 0:
            raise problem(f"{_RATE_EXPECTED} (got {shown(value)}, a division by zero)")
        rate = Fraction(int(m.group(1)), int(m.group(2)))
    else:
        raise problem(f"{_RATE_EXPECTED} (got {shown(value)})")
    if rate <= 0:
        raise problem("must be > 0")
    if rate > MAX_RATE:
        raise problem(_TOO_FAST)
    if rate < MIN_RATE:
        raise problem(_TOO_SLOW)
    return rate


def _check_magnitude(value: int | Decimal | float) -> None:
    """Range and digits, compared without building the exact fraction."""
    if isinstance(value, Decimal):
        digits = len(value.as_tuple().digits)
        if value > 0 and digits > MAX_RATE_DIGITS:
            raise problem(f"must have at most {MAX_RATE_DIGITS} digits (got {digits})")
    if value <= 0:
        raise problem("must be > 0")
    if value > MAX_RATE:
        raise problem(_TOO_FAST)
    if value < _MIN_RATE_DECIMAL:
        raise problem(_TOO_SLOW)


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
    "like 0.5 or '1/3' is kept exact) or 'unlimited'; quoted or not, the same rate.",
    "anyOf": [
        {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_RATE},
        {"const": UNLIMITED},
        {"type": "string", "pattern": r"^\s*\d+\s*/\s*[1-9]\d*\s*$"},
        {"type": "string", "pattern": r"^\s*\+?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][-+]?\d+)?\s*$"},
    ],
}

Rate = Annotated[
    RateValue,
    PlainValidator(parse_rate),
    PlainSerializer(_dump_rate),
    WithJsonSchema(RATE_SCHEMA),
]


# -- request rates ------------------------------------------------------------

MAX_REQUESTS = 1_000_000
"""Requests per window above which a request rate is a typo, not a limit."""
REQUEST_WINDOWS = {"s": 1, "min": 60}
"""The windows a request rate may be written per (`5/s`, `300/min`). Hours
and days are quotas (issue 41, item 3), not rates."""
_PER_WINDOW = re.compile(r"\s*([-+]?\d+(?:\.\d*)?)\s*/\s*([A-Za-z]*)\s*")
_REQUESTS_EXPECTED = "must be a whole number of requests per second, 'N/s', 'N/min' or 'unlimited'"


@dataclass(frozen=True, slots=True)
class RequestRate:
    """`count` requests per `window_s` seconds, as written: `5` and `5/s` are
    (5, 1), `300/min` is (300, 60). The limiter lets `count` through back to
    back, then paces them evenly at `count / window_s` per second."""

    count: int
    window_s: int

    @property
    def rate(self) -> Fraction:
        return Fraction(self.count, self.window_s)

    def __str__(self) -> str:
        unit = "min" if self.window_s == 60 else "s"
        return f"{self.count}/{unit}"


def parse_requests(value: object) -> RequestRate | Literal["unlimited"]:
    """A request rate: `5` (per second), `'5/s'`, `'300/min'` or `unlimited`.

    Whole numbers only: a request is not divisible, and the window says how
    slow (`1/min`, not `0.0167`)."""
    if isinstance(value, bool) or value is None:
        raise problem(f"{_REQUESTS_EXPECTED} (got {shown(value)})")
    window = "s"
    if isinstance(value, str):
        if value == UNLIMITED:
            return UNLIMITED
        per = _PER_WINDOW.fullmatch(value)
        number = _QUOTED_NUMBER.fullmatch(value)
        if per is not None:
            window = per.group(2)
            if window not in REQUEST_WINDOWS:
                known = " or ".join(f"'/{w}'" for w in REQUEST_WINDOWS)
                hint = " (hours and days are quotas, not rates)" if window in _QUOTA_UNITS else ""
                raise problem(
                    f"unknown window {shown(window)}: write requests per {known}{hint} "
                    f"(got {shown(value)})"
                )
            value = Decimal(per.group(1))
        elif number is not None:
            value = Decimal(number.group(1))
        else:
            raise problem(f"{_REQUESTS_EXPECTED} (got {shown(value)})")
    if not isinstance(value, int | Decimal | float):
        raise problem(f"{_REQUESTS_EXPECTED} (got {shown(value)})")
    finite = value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)
    if not finite:
        raise problem(f"must be a finite number; use 'unlimited' for no limit (got {shown(value)})")
    if value <= 0:
        raise problem("must be > 0")
    if value > MAX_REQUESTS:
        raise problem(
            f"must be at most {MAX_REQUESTS} requests per window (use 'unlimited' for no limit)"
        )
    if value != int(value):
        raise problem(
            f"must be a whole number of requests (got {shown(value)}); for fewer than one a "
            "second write 'N/min'"
        )
    return RequestRate(int(value), REQUEST_WINDOWS[window])


_QUOTA_UNITS = frozenset({"h", "hour", "hr", "d", "day", "week", "month"})


def _dump_requests(value: RequestRate | str) -> int | str:
    if isinstance(value, RequestRate):
        return value.count if value.window_s == 1 else str(value)
    return value


Requests = Annotated[
    RequestRate | Literal["unlimited"],
    PlainValidator(parse_requests),
    PlainSerializer(_dump_requests),
    WithJsonSchema(
        {
            "description": "Requests per second (a whole number), 'N/s', 'N/min', or "
            "'unlimited'; refused over it with HTTP 429 and Retry-After.",
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": MAX_REQUESTS},
                {"const": UNLIMITED},
                {"type": "string", "pattern": r"^\s*\+?\d+\s*/\s*(s|min)\s*$"},
            ],
        }
    ),
]


# -- durations --------------------------------------------------------------

_DURATION = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+))\s*(ns|us|µs|ms|s)\s*")
_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": NS_PER_S}
_DURATION_EXPECTED = "must be a duration like '100ms' or '0.25s'"


def parse_duration(value: object) -> int:
    """A duration string to whole nanoseconds, the limiter's clock unit."""
    if not isinstance(value, str):
        raise problem(f"{_DURATION_EXPECTED}, with a unit (got {shown(value)})")
    m = _DURATION.fullmatch(value)
    if m is None:
        raise problem(f"{_DURATION_EXPECTED} (got {shown(value)})")
    try:
        ns = Decimal(m.group(1)) * _UNIT_NS[m.group(2)]
    except InvalidOperation as e:  # pragma: no cover - the regex admits only decimals
        raise problem(f"{_DURATION_EXPECTED} (got {shown(value)})") from e
    if ns <= 0:
        raise problem("must be > 0")
    if ns != ns.to_integral_value():
        raise problem("must be a whole number of nanoseconds")
    if ns > MAX_BURST_NS:
        raise problem("must be at most 3600s")
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
        raise problem(f"must be a whole number >= 1 (got {shown(value)})")
    if isinstance(value, Decimal | float) and (not math.isfinite(value) or value != int(value)):
        raise problem(f"must be a whole number >= 1 (got {shown(value)})")
    if value < 1:
        raise problem("must be >= 1")
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


def not_a_string(what: str, value: object) -> PydanticCustomError:
    return PydanticCustomError("outrate", must_be_string(what, shown(value)), {"quote": what})


def _check_text(what: str, value: str, limit: int) -> None:
    """The identity rules (outrate.identity.core) for any name a policy holds."""
    if len(value) > limit:
        raise problem(f"{what} must be at most {limit} characters (got {len(value)})")
    bad = text_error(value)
    if bad is not None:
        raise problem(f"{what} {bad}: {shown(value)}")


def check_user_id(value: object) -> str:
    """User ids arrive from request bodies; reject ones no request can carry.

    A policy's `users:` key with whitespace at an end (`alice `) passes: no
    request can carry it either (`check_identity`), but refusing it would stop
    a policy that served before; `outrate lint` warns (OR009) instead."""
    if not isinstance(value, str):
        raise not_a_string("user id", value)
    if value == "":
        raise problem("user id must not be empty")
    _check_text("user id", value, MAX_USER_ID_LEN)
    if value == ANONYMOUS:
        raise problem(
            f"'{ANONYMOUS}' is reserved for requests without identity; "
            "set their limit with the top-level 'anonymous' key"
        )
    return value


def check_identity(value: object) -> str:
    """A user id a source of identity hands out (the keys file): the rules of
    `check_user_id`, and the request's own (`identity.padding_error`), so the
    keys file can name no user that a request could not."""
    user = check_user_id(value)
    bad = padding_error(user)
    if bad is not None:
        raise problem(f"user id {bad}: {shown(user)}")
    return user


UserId = Annotated[
    str,
    PlainValidator(check_user_id),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_USER_ID_LEN}),
]


def _name_checker(what: str) -> Any:
    def check(value: object) -> str:
        if not isinstance(value, str):
            raise not_a_string(what, value)
        if value == "":
            raise problem("must not be empty")
        _check_text(what, value, MAX_NAME_LEN)
        return value

    return check


_NAME_SCHEMA = WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_NAME_LEN})
Name = Annotated[str, PlainValidator(_name_checker("tier name")), _NAME_SCHEMA]
Pattern = Annotated[str, PlainValidator(_name_checker("pattern")), _NAME_SCHEMA]


def check_version(value: object) -> int:
    if isinstance(value, str) and value.strip() == "1":
        raise problem("must be the number 1, not the string '1'")
    if isinstance(value, bool) or not isinstance(value, int):
        raise problem(f"must be 1 (got {shown(value)})")
    if value != 1:
        raise problem(f"unsupported version {value}; this outrate reads version 1")
    return value
