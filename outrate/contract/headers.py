"""The rate-limit header fields of a guarded response, in the policy's style
(`headers: both | ietf | openai | off`). The mapping, and why each value is
what it is: docs/client-contract.md.

IETF (draft-ietf-httpapi-ratelimit-headers-11; Structured Fields, RFC 9651):

    RateLimit-Policy: requests;q=5;w=1, output;q=20;w=1;qu="output-tokens",
                      output-day;q=2000000;w=86400;qu="output-tokens"
    RateLimit: requests;r=4;t=1, output-day;r=1880000;t=3600

OpenAI (`x-ratelimit-*`; per minute, as OpenAI counts):

    x-ratelimit-limit-requests: 300
    x-ratelimit-remaining-requests: 4
    x-ratelimit-reset-requests: 200ms
    x-ratelimit-limit-tokens: 1200
    x-ratelimit-limit-tokens-day: 2000000
    x-ratelimit-remaining-tokens-day: 1880000
    x-ratelimit-reset-tokens-day: 1h0m0s

A limit appears when it is in force for the request: a finite rate of a rule
not in shadow. Token rates are paced in the engine, not refused, and the API
server does not see the engine's token buckets, so they carry their limit
and no remaining count. A quota (`quota:`) is refused in the API server, so
it carries its remaining amount as counted (the quota file's last save) and
its reset, the end of its UTC window. Every value is built from integers and
fixed tokens here, never from a client's or a policy's text: no value can be
malformed.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import ceil, floor

from outrate.budget.gcra import NS_PER_S, Limit, burst_count
from outrate.budget.quota import QuotaLeft
from outrate.contract.requests import Admission

Header = tuple[bytes, bytes]

SF_INTEGER_MAX = 999_999_999_999_999
"""RFC 9651 section 3.3.1: at most 15 digits."""
OUTPUT_UNIT = "output-tokens"
PROMPT_UNIT = "prompt-tokens"
"""`qu` values for token quotas: the draft registers `requests`,
`content-bytes` and `concurrent-requests` only. An unregistered `qu` (not a
parameter of our own beside it) so that a client that knows only the draft
cannot read a token quota as the default unit, requests."""


def _int(n: int) -> int:
    """A value as an sf-integer: non-negative here, at most 15 digits."""
    return max(0, min(int(n), SF_INTEGER_MAX))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quota_window(rate: Fraction) -> tuple[int, int]:
    """A rate as `q` per `w` seconds, both sf-integers: exact when both fit
    (20 -> 20/1, 0.5 -> 1/2, 1/3 -> 1/3); else the first of 1 s, 1 min, 1 h,
    1 day, 1 year with at least one unit in it, `q` rounded down."""
    if rate.numerator <= SF_INTEGER_MAX and rate.denominator <= SF_INTEGER_MAX:
        return rate.numerator, rate.denominator
    for w in (1, 60, 3600, 86400, 365 * 86400):
        q = floor(rate * w)
        if q >= 1:
            return _int(q), w
    return 1, _int(_ceil_div(rate.denominator, rate.numerator))


def per_minute(rate: Fraction) -> int:
    """A rate in units per minute, rounded down (OpenAI's RPM and TPM)."""
    return _int(floor(rate * 60))


def go_duration(ns: int) -> str:
    """A duration as OpenAI's reset headers write it (Go's `time.Duration`
    text at millisecond precision, rounded up): `0s`, `17ms`, `1.5s`, `6m0s`."""
    ms = _ceil_div(max(ns, 0), 1_000_000)
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, frac = divmod(rest, 1000)
    seconds = f"{s}.{frac:03d}".rstrip("0").rstrip(".") if frac else str(s)
    text = f"{h}h" if h else ""
    if h or m:
        text += f"{m}m"
    return f"{text}{seconds}s"


def delay_seconds(ns: int) -> int:
    """Retry-After's delay-seconds (RFC 9110 section 10.2.3): whole seconds,
    rounded up, at least 1 (a client that retries sooner is refused again)."""
    return _int(max(1, _ceil_div(ns, NS_PER_S)))


def _enforced(lim: Limit | None) -> Limit | None:
    if lim is None or lim.rate is None or lim.shadow:
        return None
    return lim


UNITS = {"output": OUTPUT_UNIT, "prompt": PROMPT_UNIT}
OPENAI_KINDS = {"output": "tokens", "prompt": "input-tokens"}
"""The words of the OpenAI-style names, as for the rates: output tokens are
OpenAI's `tokens`, prompt tokens its `input-tokens`."""


def _ietf_quotas(quotas: Sequence[QuotaLeft]) -> tuple[list[str], list[str]]:
    """(RateLimit-Policy items, RateLimit items) of the quotas: one policy
    named `KIND-WINDOW` each (`output-day`), `w` the current window's length
    in seconds."""
    policies, states = [], []
    for q in quotas:
        name = f"{q.quota.kind}-{q.quota.window}"
        unit = UNITS[q.quota.kind]
        policies.append(f'{name};q={_int(q.quota.tokens)};w={_int(q.window_s)};qu="{unit}"')
        states.append(f"{name};r={_int(q.remaining)};t={_int(ceil(q.reset_s))}")
    return policies, states


def _ietf(rule: Limit, admission: Admission, quotas: Sequence[QuotaLeft] = ()) -> list[Header]:
    policies: list[str] = []
    requests = _enforced(admission.limit)
    if requests is not None:
        assert requests.rate is not None
        count = burst_count(requests)
        window = Fraction(count) / requests.rate
        if window.denominator == 1:
            policies.append(f"requests;q={_int(count)};w={_int(window.numerator)}")
        else:  # not written by a policy (N/s, N/min), but never malformed
            q, w = quota_window(requests.rate)
            policies.append(f"requests;q={q};w={w}")
    output = _enforced(rule)
    if output is not None and output.rate is not None:
        q, w = quota_window(output.rate)
        policies.append(f'output;q={q};w={w};qu="{OUTPUT_UNIT}"')
    prompt = _enforced(rule.prompt)  # a rule in shadow: its prompt limit too
    if prompt is not None and prompt.rate is not None:
        q, w = quota_window(prompt.rate)
        policies.append(f'prompt;q={q};w={w};qu="{PROMPT_UNIT}"')
    quota_policies, states = _ietf_quotas(quotas)
    policies += quota_policies
    if requests is not None:
        remaining = max(admission.remaining, 0)
        reset = _ceil_div(admission.reset_ns, NS_PER_S)
        states.insert(0, f"requests;r={_int(remaining)};t={_int(reset)}")
    out: list[Header] = []
    if policies:
        out.append((b"ratelimit-policy", ", ".join(policies).encode("ascii")))
    if states:
        out.append((b"ratelimit", ", ".join(states).encode("ascii")))
    return out


def _openai(rule: Limit, admission: Admission, quotas: Sequence[QuotaLeft] = ()) -> list[Header]:
    out: list[Header] = []
    requests = _enforced(admission.limit)
    if requests is not None and requests.rate is not None:
        out += [
            (b"x-ratelimit-limit-requests", str(per_minute(requests.rate)).encode()),
            (b"x-ratelimit-remaining-requests", str(_int(admission.remaining)).encode()),
            (b"x-ratelimit-reset-requests", go_duration(admission.reset_ns).encode()),
        ]
    output = _enforced(rule)
    if output is not None and output.rate is not None:
        out.append((b"x-ratelimit-limit-tokens", str(per_minute(output.rate)).encode()))
    prompt = _enforced(rule.prompt)
    if prompt is not None and prompt.rate is not None:
        out.append((b"x-ratelimit-limit-input-tokens", str(per_minute(prompt.rate)).encode()))
    for q in quotas:  # x-ratelimit-limit-tokens-day: OpenAI's words, the window after
        suffix = f"{OPENAI_KINDS[q.quota.kind]}-{q.quota.window}"
        reset_ns = ceil(q.reset_s * NS_PER_S)
        out += [
            (f"x-ratelimit-limit-{suffix}".encode(), str(_int(q.quota.tokens)).encode()),
            (f"x-ratelimit-remaining-{suffix}".encode(), str(_int(q.remaining)).encode()),
            (f"x-ratelimit-reset-{suffix}".encode(), go_duration(reset_ns).encode()),
        ]
    return out


def limit_headers(
    style: str, rule: Limit, admission: Admission, quotas: Sequence[QuotaLeft] = ()
) -> list[Header]:
    """The fields a guarded response carries: `rule` is the user's limit as
    the policy in force at admission resolved it, `admission` its request's
    decision, `quotas` the rule's quotas in force with what is left of each
    as counted (outrate.contract.quotas.QuotaView.state)."""
    out: list[Header] = []
    if style in ("ietf", "both"):
        out += _ietf(rule, admission, quotas)
    if style in ("openai", "both"):
        out += _openai(rule, admission, quotas)
    return out


def refusal_headers(
    style: str, rule: Limit, admission: Admission, quotas: Sequence[QuotaLeft] = ()
) -> list[Header]:
    """A 429's fields: Retry-After always (whatever the style: RFC 9110's
    answer to "when"), `retry-after-ms` with OpenAI's style (the openai
    clients honour it first), and the limits."""
    out = [(b"retry-after", str(delay_seconds(admission.retry_after_ns)).encode())]
    if style in ("openai", "both"):
        ms = max(1, _ceil_div(admission.retry_after_ns, 1_000_000))
        out.append((b"retry-after-ms", str(_int(ms)).encode()))
    return out + limit_headers(style, rule, admission, quotas)


def refusal_message(admission: Admission) -> str:
    """The 429's message: the user's own request rate and when to retry;
    never a rule's name (tiers and patterns are the operator's business)."""
    lim = admission.limit
    assert lim.rate is not None
    count = burst_count(lim)
    window = Fraction(count) / lim.rate
    per = {1: "second", 60: "minute"}.get(int(window), f"{float(window):g} seconds")
    wait = admission.retry_after_ns / NS_PER_S
    return (
        f"Rate limit reached for requests: at most {count} per {per}. "
        f"Please try again in {wait:.3g}s."
    )
