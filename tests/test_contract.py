"""The client contract's core: the request table (outrate.contract.requests)
and the rate-limit header fields (outrate.contract.headers), without a
server. Every header value is parsed back with a strict parser of RFC 9651's
grammar for the fields the draft defines; the table runs on a fake clock."""

from __future__ import annotations

import calendar
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outrate.budget.gcra import NS_PER_S, burst_count, per_window
from outrate.budget.quota import quota_state, spent_of, window_bounds
from outrate.contract.headers import (
    SF_INTEGER_MAX,
    delay_seconds,
    go_duration,
    limit_headers,
    per_minute,
    quota_window,
    refusal_headers,
    refusal_message,
)
from outrate.contract.quotas import QuotaView
from outrate.contract.requests import RequestTable
from outrate.identity.core import ANONYMOUS
from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.loader import parse_policy


def compiled(text: str) -> CompiledPolicy:
    return compile_policy(parse_policy("version: 1\n" + text, "p.yaml"), "p.yaml")


# -- a strict reader of the fields (RFC 9651 sections 3.1, 3.1.2, 3.3) -----------

_KEY = r"[a-z*][a-z0-9_\-.*]*"
_TOKEN = r"[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*"
_INTEGER = r"-?[0-9]{1,15}"
_STRING = r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"'
_BARE = rf"(?:{_INTEGER}|{_STRING}|{_TOKEN})"
_PARAMS = rf"(?:;{_KEY}(?:={_BARE})?)*"
_ITEM = re.compile(rf"({_BARE})({_PARAMS})")
_PARAM = re.compile(rf";({_KEY})(?:=({_BARE}))?")


def sf_list(value: bytes) -> list[tuple[str, dict[str, str]]]:
    """An sf-list of items with parameters, exactly per the grammar (members
    separated by `OWS "," OWS`), or an AssertionError."""
    text = value.decode("ascii")
    assert text == text.strip(" ") and text, f"{text!r}: no leading or trailing space, not empty"
    out = []
    for member in re.split(r"[ \t]*,[ \t]*", text):
        m = _ITEM.fullmatch(member)
        assert m is not None, f"{member!r} is not an sf-item"
        params = dict(_PARAM.findall(m.group(2)))
        out.append((m.group(1), params))
    return out


def check_draft_fields(fields: dict[bytes, bytes]) -> None:
    """RateLimit-Policy and RateLimit as the draft defines them: items named
    by a token, `q` (and `w`, `r`, `t`) non-negative sf-integers, `qu` a string."""
    if b"ratelimit-policy" in fields:
        for name, params in sf_list(fields[b"ratelimit-policy"]):
            assert re.fullmatch(_TOKEN, name)
            assert set(params) <= {"q", "w", "qu"} and "q" in params
            assert re.fullmatch(r"[0-9]{1,15}", params["q"]) and int(params["q"]) >= 1
            assert re.fullmatch(r"[1-9][0-9]{0,14}", params.get("w", "1"))
            assert re.fullmatch(_STRING, params.get("qu", '"requests"'))
    if b"ratelimit" in fields:
        for name, params in sf_list(fields[b"ratelimit"]):
            assert re.fullmatch(_TOKEN, name) and set(params) == {"r", "t"}
            assert re.fullmatch(r"[0-9]{1,15}", params["r"])
            assert re.fullmatch(r"[0-9]{1,15}", params["t"])
    duration = rb"0s|[1-9][0-9]{0,2}ms|([1-9][0-9]*h)?([0-9]+m)?[0-9]+(\.[0-9]{1,3})?s"
    for name, value in fields.items():
        if name in (b"retry-after", b"retry-after-ms") or name.startswith(
            (b"x-ratelimit-limit-", b"x-ratelimit-remaining-")
        ):
            assert re.fullmatch(rb"[0-9]{1,15}", value), (name, value)
        elif name.startswith(b"x-ratelimit-reset-"):
            assert re.fullmatch(duration, value), (name, value)
        elif name.startswith(b"x-ratelimit-"):
            raise AssertionError(f"{name!r}: not a limit, remaining or reset field")


def test_the_reader_refuses_what_the_grammar_does():
    for bad in (b"", b" a", b"a,", b"1a;q=1", b"a;Q=1", b'a;qu="x\\y"', b"a;q=1234567890123456"):
        with pytest.raises(AssertionError):
            sf_list(bad)
    assert sf_list(b'a;q=1;w=60, b;qu="x-y"') == [("a", {"q": "1", "w": "60"}),
                                                   ("b", {"qu": '"x-y"'})]  # fmt: skip


# -- header values ------------------------------------------------------------------


def test_both_styles_for_a_user_with_every_limit():
    policy = compiled("default: {rate: 20, requests: 5, prompt: 1000}\n")
    table = RequestTable(clock=lambda: 0)
    admission = table.admit(policy, "bob", now=NS_PER_S)
    fields = dict(limit_headers("both", policy.limit_for("bob"), admission))
    assert fields == {
        b"ratelimit-policy": b'requests;q=5;w=1, output;q=20;w=1;qu="output-tokens", '
        b'prompt;q=1000;w=1;qu="prompt-tokens"',
        b"ratelimit": b"requests;r=4;t=1",
        b"x-ratelimit-limit-requests": b"300",
        b"x-ratelimit-remaining-requests": b"4",
        b"x-ratelimit-reset-requests": b"200ms",
        b"x-ratelimit-limit-tokens": b"1200",
        b"x-ratelimit-limit-input-tokens": b"60000",
    }
    check_draft_fields(fields)
    ietf = dict(limit_headers("ietf", policy.limit_for("bob"), admission))
    assert set(ietf) == {b"ratelimit-policy", b"ratelimit"}
    openai = dict(limit_headers("openai", policy.limit_for("bob"), admission))
    assert all(name.startswith(b"x-ratelimit-") for name in openai)
    assert limit_headers("off", policy.limit_for("bob"), admission) == []


def test_a_refusal_says_when_and_what():
    policy = compiled("default: {rate: unlimited, requests: 300/min}\n")
    table = RequestTable(clock=lambda: 0)
    for _ in range(300):
        assert table.admit(policy, "bob", now=0).admitted
    refused = table.admit(policy, "bob", now=0)
    assert not refused.admitted and refused.retry_after_ns == 200_000_000
    fields = dict(refusal_headers("both", policy.limit_for("bob"), refused))
    check_draft_fields(fields)
    assert fields[b"retry-after"] == b"1" and fields[b"retry-after-ms"] == b"200"
    assert fields[b"ratelimit-policy"] == b"requests;q=300;w=60"  # no output rate: unlimited
    assert fields[b"ratelimit"] == b"requests;r=0;t=60"
    assert fields[b"x-ratelimit-limit-requests"] == b"300"
    assert fields[b"x-ratelimit-reset-requests"] == b"1m0s"
    assert b"x-ratelimit-limit-tokens" not in fields
    assert refusal_message(refused) == (
        "Rate limit reached for requests: at most 300 per minute. Please try again in 0.2s."
    )
    assert dict(refusal_headers("off", policy.limit_for("bob"), refused)) == {b"retry-after": b"1"}


def test_quotas_say_what_is_left_and_when_it_resets(tmp_path):
    """Each quota in force: its own policy item (`output-day`, `w` the window's
    length) and its remaining amount and reset, in both styles; a spent one
    says 0, with Retry-After to its reset on the 429."""
    policy = compiled(
        "default: {rate: 20, requests: 5, quota: {output: 2M/day, prompt: 50K/month}}\n"
    )
    rule = policy.limit_for("bob")
    admission = RequestTable(clock=lambda: 0).admit(policy, "bob", now=NS_PER_S)
    now = float(calendar.timegm((2026, 12, 4, 23, 0, 0)))  # 1 h to midnight, 27 d to January
    usage = {"output/day": [int(now) - 23 * 3600, 120_000], "prompt/month": [0, 7]}
    quotas = quota_state(rule.quotas, usage, now)
    fields = dict(limit_headers("both", rule, admission, quotas))
    check_draft_fields(fields)
    assert fields[b"ratelimit-policy"] == (
        b'requests;q=5;w=1, output;q=20;w=1;qu="output-tokens", '
        b'output-day;q=2000000;w=86400;qu="output-tokens", '
        b'prompt-month;q=50000;w=2678400;qu="prompt-tokens"'
    )  # the month's usage row is from another month: nothing counted in this one
    assert fields[b"ratelimit"] == (
        b"requests;r=4;t=1, output-day;r=1880000;t=3600, prompt-month;r=50000;t=2336400"
    )
    assert fields[b"x-ratelimit-limit-tokens-day"] == b"2000000"
    assert fields[b"x-ratelimit-remaining-tokens-day"] == b"1880000"
    assert fields[b"x-ratelimit-reset-tokens-day"] == b"1h0m0s"
    assert fields[b"x-ratelimit-limit-input-tokens-month"] == b"50000"
    assert fields[b"x-ratelimit-remaining-input-tokens-month"] == b"50000"
    assert fields[b"x-ratelimit-reset-input-tokens-month"] == b"649h0m0s"
    usage["output/day"][1] = 2_000_001  # an overrun: counted, never below 0
    quotas = quota_state(rule.quotas, usage, now + 0.25)
    spent = spent_of(quotas)
    assert spent is not None and spent.quota.window == "day" and spent.used == 2_000_001
    refused = admission._replace(retry_after_ns=int(spent.reset_s * NS_PER_S))
    fields = dict(refusal_headers("both", rule, refused, quotas))
    check_draft_fields(fields)
    assert fields[b"retry-after"] == b"3600" and fields[b"x-ratelimit-remaining-tokens-day"] == b"0"
    assert b"output-day;r=0;t=3600" in fields[b"ratelimit"]
    assert fields[b"x-ratelimit-reset-tokens-day"] == b"59m59.75s"
    assert set(dict(limit_headers("ietf", rule, admission, quotas))) == {
        b"ratelimit-policy",
        b"ratelimit",
    }
    view = QuotaView(str(tmp_path / "no-usage-yet.json"), clock=lambda: now)
    assert view.state(rule, "bob") == quota_state(rule.quotas, {}, now)  # all of it left
    shadow = compiled("default: {rate: 20, shadow: true, quota: {output: 1K/hour}}\n")
    assert view.state(shadow.limit_for("bob"), "bob") == []  # not in force: not advertised


def test_shadow_limits_are_not_advertised_and_unlimited_users_get_none():
    policy = compiled(
        "default: unlimited\nusers:\n  sam: {rate: 20, requests: 1, prompt: 100, shadow: true}\n"
    )
    table = RequestTable(clock=lambda: 0)
    first, second = (table.admit(policy, "sam", now=0) for _ in range(2))
    assert first.admitted and not first.over
    assert second.admitted and second.over  # counted, not refused
    assert limit_headers("both", policy.limit_for("sam"), second) == []
    assert limit_headers("both", policy.limit_for("zed"), table.admit(policy, "zed")) == []


def test_no_identity_means_the_anonymous_rule():
    policy = compiled(
        "default: {rate: 100, requests: 100}\n"
        "anonymous: {rate: 3, requests: 1/min}\n"
        "users:\n  bob: {rate: 50, requests: 50}\n"
    )
    table = RequestTable(clock=lambda: 0)
    anon = table.admit(policy, ANONYMOUS, now=0)
    fields = dict(limit_headers("ietf", policy.limit_for(ANONYMOUS), anon))
    assert fields[b"ratelimit-policy"] == b'requests;q=1;w=60, output;q=3;w=1;qu="output-tokens"'
    assert not table.admit(policy, ANONYMOUS, now=0).admitted
    assert table.admit(policy, "bob", now=0).remaining == 49  # bob's own bucket, untouched


@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        (Fraction(20), (20, 1)),
        (Fraction(1, 2), (1, 2)),
        (Fraction(1, 3), (1, 3)),
        (Fraction(1, 1_000_000), (1, 1_000_000)),
        (Fraction(10**29 + 1, 10**29), (1, 1)),  # 30 digits each: rounded down to fit
        (Fraction(10**29, 10**29 + 1), (59, 60)),
    ],
)
def test_quota_windows(rate: Fraction, expected: tuple[int, int]) -> None:
    assert quota_window(rate) == expected


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "0s"),
        (1, "1ms"),
        (17_000_000, "17ms"),
        (999_999_999, "1s"),
        (1_500_000_000, "1.5s"),
        (60 * NS_PER_S, "1m0s"),
        (3_723_250_000_000, "1h2m3.25s"),
    ],
)
def test_reset_durations_read_like_openais(ns: int, text: str) -> None:
    assert go_duration(ns) == text


def test_retry_after_is_whole_seconds_rounded_up():
    assert [delay_seconds(ns) for ns in (0, 1, NS_PER_S, NS_PER_S + 1)] == [1, 1, 1, 2]
    assert per_minute(Fraction(1, 3)) == 20 and per_minute(Fraction(1, 10**6)) == 0


_rates = st.one_of(
    st.integers(1, 1_000_000).map(Fraction),
    st.fractions(Fraction(1, 10**6), 10**6, max_denominator=10**30).filter(
        lambda f: f > 0 and max(f.numerator, f.denominator) < 10**30  # the loader: 30 digits
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    rate=_rates,
    prompt=st.one_of(st.none(), _rates),
    count=st.integers(1, 1_000_000),
    window=st.sampled_from(["s", "min"]),
    asks=st.integers(1, 5),
    at=st.integers(0, 10**15),
    quota=st.one_of(
        st.none(),
        st.tuples(
            st.integers(1, 10**12), st.sampled_from(["hour", "day", "week", "month"]),
            st.integers(0, 10**13), st.floats(0, 4 * 10**9),
        ),
    ),
)  # fmt: skip
def test_every_value_is_well_formed(rate, prompt, count, window, asks, at, quota) -> None:
    """Any policy the loader accepts, any state, any quota usage at any time:
    every field parses."""
    text = f"{rate.numerator}/{rate.denominator}"
    rule = f"{{rate: '{text}', requests: '{count}/{window}'"
    if prompt is not None:
        rule += f", prompt: '{prompt.numerator}/{prompt.denominator}'"
    usage: dict[str, list[int]] = {}
    now = 0.0
    if quota is not None:
        tokens, per, used, now = quota
        rule += f", quota: {{output: {tokens}/{per}, prompt: {tokens}/{per}}}"
        usage[f"output/{per}"] = [window_bounds(per, now)[0], used]
    policy = compiled(f"default: {rule}}}\n")
    table = RequestTable(clock=lambda: at)
    for _ in range(asks):
        admission = table.admit(policy, "u")
    quotas = quota_state(policy.limit_for("u").quotas, usage, now)
    style_fields = refusal_headers("both", policy.limit_for("u"), admission, quotas)
    assert all(value.isascii() and b"\r" not in value and b"\n" not in value
               for _, value in style_fields)  # fmt: skip
    check_draft_fields(dict(style_fields))


# -- the request table ------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 20),
    window=st.sampled_from([1, 60]),
    gaps=st.lists(st.integers(0, 400_000_000), min_size=1, max_size=120),
)
def test_in_any_window_at_most_rate_times_w_plus_count(count, window, gaps) -> None:
    """The GCRA bound for requests: admitted in [t1, t2] <= (t2 - t1) * rate + count."""
    policy = compiled(
        f"default: {{rate: unlimited, requests: '{count}/{'s' if window == 1 else 'min'}'}}\n"
    )
    table = RequestTable(clock=lambda: 0)
    now, times = 0, []
    for gap in gaps:
        now += gap
        if table.admit(policy, "u", now=now).admitted:
            times.append(now)
    rate = Fraction(count, window)
    for i in range(len(times)):
        for j in range(i, len(times)):
            assert j - i + 1 <= Fraction(times[j] - times[i], NS_PER_S) * rate + count


def test_a_burst_of_count_then_the_rate():
    """`requests: 5`: 5 at once, then one every 200 ms; 200 asks a second for
    3 s (asks at 0, 5 ms, ..., 3 s) get 5 + 15 through (the allowance)."""
    policy = compiled("default: {rate: unlimited, requests: 5}\n")
    table = RequestTable(clock=lambda: 0)
    admitted = sum(table.admit(policy, "u", now=i * 5_000_000).admitted for i in range(601))
    assert admitted == 5 + 15
    assert burst_count(per_window(5, 1)) == 5


def test_a_reload_carries_each_users_debt_in_requests():
    old = compiled("default: {rate: unlimited, requests: 2}\n")
    new = compiled("default: {rate: unlimited, requests: 10}\n")
    table = RequestTable(clock=lambda: 0)
    assert [table.admit(old, "u", now=0).admitted for _ in range(3)] == [True, True, False]
    # under the new rate the user has 10 - 2 requests of its burst left
    assert sum(table.admit(new, "u", now=0).admitted for _ in range(20)) == 8
    assert table.admit(compiled("default: unlimited\n"), "u", now=0).remaining == -1


def test_idle_users_are_forgotten():
    policy = compiled("default: {rate: unlimited, requests: 1}\n")
    table = RequestTable(clock=lambda: 0)
    for i in range(100):
        table.admit(policy, f"user-{i}", now=0)
    assert len(table) == 100
    for i in range(20):
        table.admit(policy, "late", now=10 * NS_PER_S + i)
    assert len(table) <= 2
    assert SF_INTEGER_MAX == 10**15 - 1
