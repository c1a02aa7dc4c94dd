"""The policy models: value rules, immutability, dumping, and the JSON Schema."""

from __future__ import annotations

import json
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from outrate.cli import schema_text
from outrate.identity.core import ANONYMOUS, text_error
from outrate.policy.loader import parse_policy
from outrate.policy.model import LimitRule, MatchRule, Policy, TierRule, policy_json_schema
from outrate.policy.values import (
    DEFAULT_BURST_NS,
    MAX_RATE,
    UNLIMITED,
    check_identity,
    check_user_id,
    parse_duration,
    parse_rate,
)
from outrate.units import format_count, format_duration, format_rate

ROOT = Path(__file__).parent.parent


def test_models_are_frozen_and_strict() -> None:
    policy = Policy.model_validate({"version": 1, "default": 5})
    with pytest.raises(ValidationError):
        policy.default = LimitRule(rate=Fraction(1))  # type: ignore[misc]
    for model in (Policy, LimitRule, TierRule, MatchRule):
        assert model.model_config.get("frozen") is True
        assert model.model_config.get("extra") == "forbid"


def test_defaults() -> None:
    policy = Policy.model_validate({"version": 1, "default": "unlimited"})
    assert policy.burst == DEFAULT_BURST_NS == 100_000_000
    assert policy.anonymous is None
    assert policy.tiers == {} and policy.users == {} and policy.match == ()
    assert policy.default.rate == UNLIMITED


def test_direct_construction_checks_tier_references() -> None:
    """The loader reports these with positions; direct use is guarded too, so a
    Policy object can never reach the compiler with a dangling tier."""
    with pytest.raises(ValidationError, match=r"users\.bob\.tier: unknown tier 'gold'"):
        Policy.model_validate({"version": 1, "default": 1, "users": {"bob": {"tier": "gold"}}})


def test_direct_construction_checks_peaks_above_a_tier() -> None:
    """A rule's own peak is checked by its model; one beside a tier needs the
    tier's rate, so the policy checks it (the loader first, with positions)."""
    data = {"version": 1, "default": 1, "tiers": {"free": {"rate": 20, "peak": 40}}}
    with pytest.raises(
        ValidationError, match=r"users\.bob\.peak: must be at least the rate of tier 'free'"
    ):
        Policy.model_validate({**data, "users": {"bob": {"tier": "free", "peak": 10}}})
    with pytest.raises(ValidationError, match=r"match\.0\.peak: cannot be set here: tier 'x'"):
        Policy.model_validate(
            {
                **data,
                "tiers": {"x": "unlimited"},
                "match": [{"pattern": "a*", "tier": "x", "peak": 5}],
            }
        )
    ok = Policy.model_validate({**data, "users": {"bob": {"tier": "free", "peak": 20}}})
    assert ok.users["bob"].peak == 20  # equal to the tier's rate: no borrowing, allowed


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"rate": 20, "peak": 10}, r"must be at least the rate \(20 tok/s\)"),
        ({"rate": "unlimited", "peak": "unlimited"}, "cannot be set on an unlimited rule"),
        ({"rate": 20, "peak": "fast"}, "must be a number of tokens per second"),
    ],
)
def test_peak_rules_hold_for_every_kind_of_rule(rule: dict[str, object], message: str) -> None:
    for model in (TierRule, LimitRule):
        with pytest.raises(ValidationError, match=message):
            model.model_validate(rule)
    with pytest.raises(ValidationError, match=message):
        MatchRule.model_validate({"pattern": "a*", **rule})
    for key in ("default", "anonymous"):
        with pytest.raises(ValidationError, match=message):
            Policy.model_validate({"version": 1, "default": 1, key: rule})


def test_a_peak_dumps_and_reloads() -> None:
    policy = Policy.model_validate(
        {
            "version": 1,
            "default": {"rate": "1/3", "peak": "2/3"},
            "tiers": {"t": {"rate": 20, "peak": "unlimited"}},
            "users": {"u": {"tier": "t", "peak": 20.5}},
        }
    )
    text = yaml.safe_dump(policy.model_dump(mode="json", exclude_none=True))
    assert "peak: 2/3" in text and "peak: unlimited" in text
    assert parse_policy(text, "dumped.yaml") == policy


def test_quotas_dump_and_reload() -> None:
    """`quota: unlimited` (a tier's quota overridden) dumps as `unlimited`,
    not `{}`, which the loader refuses ("names no quota")."""
    policy = parse_policy(
        "version: 1\n"
        "default: {rate: 20, quota: {output: 2M/day, prompt: '1.5K/hour'}}\n"
        "tiers:\n  free: {rate: 5, quota: {output: 10K/week}}\n"
        "users:\n  bob: {tier: free, quota: unlimited}\n",
        "p.yaml",
    )
    dumped = policy.model_dump(mode="json", exclude_none=True)
    assert dumped["users"]["bob"]["quota"] == "unlimited"
    assert dumped["default"]["quota"] == {"output": "2000000/day", "prompt": "1500/hour"}
    text = yaml.safe_dump(dumped)
    assert parse_policy(text, "dumped.yaml") == policy
    assert policy.model_dump()["users"]["bob"]["quota"] == "unlimited"


@pytest.mark.parametrize(
    ("value", "rate"),
    [
        (1, Fraction(1)),
        (0.1, Fraction(1, 10)),
        (Decimal("2.5"), Fraction(5, 2)),
        ("3/4", Fraction(3, 4)),
        (" 1 / 3 ", Fraction(1, 3)),
        (Fraction(7, 3), Fraction(7, 3)),
        (MAX_RATE, Fraction(MAX_RATE)),
        ("unlimited", UNLIMITED),
    ],
)
def test_parse_rate(value: object, rate: object) -> None:
    assert parse_rate(value) == rate


@pytest.mark.parametrize(
    "value", [0, -1, float("nan"), float("inf"), True, False, None, "fast", "", [], MAX_RATE + 0.5]
)
def test_parse_rate_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_rate(value)


def test_durations_round_trip() -> None:
    for ns in (1, 999, 1_000, 1_500_000, 100_000_000, 250_000_000, 2_000_000_000):
        assert parse_duration(format_duration(ns)) == ns
    assert format_duration(100_000_000) == "100ms"
    assert format_duration(2_000_000_000) == "2s"
    assert format_duration(1_500) == "1500ns"
    assert format_duration(1_500_000) == "1500us"


def test_one_spelling_each_for_rates_and_counts():
    assert format_rate(None) == "unlimited"
    assert format_rate(Fraction(20)) == "20"
    assert format_rate(Fraction(1, 2)) == "0.5"
    assert format_count(1, "error") == "1 error"
    assert format_count(0, "warning") == "0 warnings"


def test_user_ids() -> None:
    assert check_user_id("team-x/bob@example.com") == "team-x/bob@example.com"
    assert check_user_id("ü" * 256) == "ü" * 256
    invisible = ("a\x85b", "a\u202eb", "a\u200bb", "a\u2028b", "a\ud800b")
    for bad in ("", "a" * 257, "a\nb", "a\x7fb", *invisible, ANONYMOUS, 5, None):
        with pytest.raises(ValueError):
            check_user_id(bad)
        with pytest.raises(ValueError):
            check_identity(bad)


def test_whitespace_at_an_end_is_refused_where_an_identity_comes_from() -> None:
    """The keys file (check_identity) names no user a request could not carry;
    a policy's `users:` key keeps loading (lint warns, OR009)."""
    assert check_identity("Zoë Müller") == "Zoë Müller"
    for padded in ("alice ", " alice", "alice\u00a0", "\u2003alice", "alice\u3000"):
        assert check_user_id(padded) == padded
        with pytest.raises(ValueError, match=r"user id must not begin or end with whitespace"):
            check_identity(padded)


# -- round trips ------------------------------------------------------------------

# Every character the identity rules allow (no Cc, Cf, Zl, Zp, Cs).
user_ids = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF).filter(
        lambda c: text_error(c) is None
    ),
    min_size=1,
    max_size=40,
).filter(lambda s: s != ANONYMOUS)
rates = st.one_of(
    st.integers(min_value=1, max_value=MAX_RATE),
    st.decimals(min_value=Decimal("0.001"), max_value=Decimal(MAX_RATE), places=3),
    st.fractions(min_value=Fraction(1, 1000), max_value=1000, max_denominator=10**29).filter(
        lambda f: f > 0 and len(str(f.numerator)) <= 30
    ),
    st.just(UNLIMITED),
)


def _yaml_rate(rate: object) -> object:
    if isinstance(rate, Fraction):
        return f"{rate.numerator}/{rate.denominator}"
    if isinstance(rate, Decimal):
        return float(rate)  # 3 decimal places: the float's repr is the same number
    return rate


@given(st.dictionaries(user_ids, rates, max_size=20))
def test_any_valid_users_round_trip(users: dict[str, object]) -> None:
    """Every user written with a valid rate loads back with exactly that rate."""
    data = {"version": 1, "default": 1, "users": {u: _yaml_rate(r) for u, r in users.items()}}
    policy = parse_policy(yaml.safe_dump(data, allow_unicode=True), "p.yaml")
    assert set(policy.users) == set(users)
    for uid, rate in users.items():
        expected = rate if rate == UNLIMITED else parse_rate(rate)
        assert policy.users[uid].rate == expected


@given(st.dictionaries(user_ids, rates, max_size=10), rates)
def test_dump_reloads_to_an_equal_policy(users: dict[str, object], default: object) -> None:
    policy = Policy.model_validate(
        {"version": 1, "default": default, "users": users, "burst": "250ms"}
    )
    text = yaml.safe_dump(policy.model_dump(mode="json", exclude_none=True), allow_unicode=True)
    assert parse_policy(text, "dumped.yaml") == policy


# -- schema -----------------------------------------------------------------------


def test_schema_is_stable_and_shipped() -> None:
    text = schema_text()
    # canonical form (sorted keys, 2-space indent): regenerating never reorders
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert (ROOT / "policies" / "policy.schema.json").read_text() == text
    assert (ROOT / "outrate" / "policy.schema.json").read_text() == text


def test_schema_describes_the_format() -> None:
    schema = policy_json_schema()
    assert schema["required"] == ["version", "default"]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {
        "version", "default", "anonymous", "burst", "mode", "headers", "metrics", "identity",
        "tiers", "users", "match",
    }  # fmt: skip
    assert schema["properties"]["version"] == {
        "const": 1,
        "description": "Format version; must be 1.",
        "title": "Version",
    }  # noqa: E501
    # a limit spec may be a bare rate or a mapping
    kinds = json.dumps(schema["properties"]["default"])
    assert '"const": "unlimited"' in kinds and "#/$defs/LimitRule" in kinds
    assert "tier" not in schema["$defs"]["TierRule"]["properties"]
    for rule in ("TierRule", "LimitRule", "MatchRule"):
        peak = schema["$defs"][rule]["properties"]["peak"]
        assert "borrow" in peak["description"] and '"const": "unlimited"' in json.dumps(peak)
    identity = schema["$defs"]["IdentitySection"]["properties"]
    assert identity["source"]["enum"] == ["body", "header", "api_key"]
    assert identity["on_claim_mismatch"]["enum"] == ["reject", "ignore"]
