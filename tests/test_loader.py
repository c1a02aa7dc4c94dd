"""Loader tests, driven by fixtures: one file per kind of bad policy under
tests/fixtures/bad/, each with its exact messages (file:line:col included)."""

from __future__ import annotations

import os
import time
import tracemalloc
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from outrate.errors import OutrateError, PolicyError, Problem
from outrate.policy import compose
from outrate.policy.loader import field_path, load_policy, parse_policy
from outrate.policy.pipeline import policy_from_flags
from outrate.policy.specs import NO_PEAK, NO_PROMPT, NO_REQUESTS
from outrate.policy.values import UNLIMITED, RequestRate

BAD = Path(__file__).parent / "fixtures" / "bad"
LOADERS = [compose.FAST_LOADER, compose.PureLoader]  # libyaml first, where installed

# fixture name -> the exact messages, in file order; FILE stands for its path.
EXPECTED: dict[str, list[str]] = {
    "identity_header_authorization": [
        "FILE:5:11: identity.header: cannot be 'authorization': use 'source: api_key' for "
        "Authorization: Bearer keys",
    ],
    "identity_header_invalid": [
        "FILE:5:11: identity.header: must be an HTTP header name (letters, digits and "
        "!#$%&'*+-.^_`|~; got 'x user')",
    ],
    "identity_header_missing": [
        "FILE:4:3: identity: missing; 'source: header' needs 'header': the name of the "
        "header your gateway sets",
    ],
    "identity_keys_missing": [
        "FILE:4:3: identity: missing; 'source: api_key' needs 'keys': the keys file "
        "(sha256:<hex>: user id)",
    ],
    "identity_keys_with_header": [
        "FILE:6:9: identity.keys: only read with 'source: api_key' (the source here is "
        "'header'); remove it",
    ],
    "identity_mismatch_unknown": [
        "FILE:6:22: identity.on_claim_mismatch: must be 'reject' or 'ignore' (got 'drop')",
    ],
    "identity_mismatch_with_body": [
        "FILE:4:22: identity.on_claim_mismatch: only read with 'source: header' or "
        "'source: api_key' (with source body the claim is the identity); remove it",
    ],
    "identity_not_mapping": [
        "FILE:3:11: identity: must be a mapping (got 'api_key')",
    ],
    "identity_source_unknown": [
        "FILE:4:11: identity.source: must be 'body', 'header' or 'api_key' (got 'jwt')",
    ],
    "identity_unknown_key": [
        "FILE:4:3: identity: unknown key 'sorce' (did you mean 'source'?)",
    ],
    "metrics_max_series_negative": [
        "FILE:5:15: metrics.max_series: must be >= 0",
    ],
    "metrics_unknown_key": [
        "FILE:4:3: metrics: unknown key 'per_users' (did you mean 'per_user'?)",
    ],
    "mode_unknown": [
        "FILE:2:7: mode: must be 'enforce' or 'shadow' (got 'dry-run')",
    ],
    "shadow_not_bool": [
        "FILE:4:29: users.alice.shadow: must be true or false (got 'yes')",
    ],
    "prompt_peak_below_rate": [
        "FILE:4:47: users.alice.prompt.peak: must be at least the rate (500 tok/s): the peak "
        "is the ceiling above the rate that borrowing may reach",
    ],
    "prompt_zero": ["FILE:2:29: default.prompt: must be > 0"],
    "requests_unknown_window": [
        "FILE:2:31: default.requests: unknown window 'hour': write requests per '/s' or "
        "'/min' (hours and days are quotas, not rates) (got '5/hour')"
    ],
    "requests_zero": ["FILE:4:30: tiers.free.requests: must be > 0"],
    "headers_unknown": [
        "FILE:3:10: headers: must be 'both', 'ietf', 'openai' or 'off' (got 'draft')"
    ],
    "peak_below_rate": [
        "FILE:4:27: users.alice.peak: must be at least the rate (20 tok/s): the peak is the "
        "ceiling above the rate that borrowing may reach",
    ],
    "peak_below_tier_rate": [
        "FILE:6:27: users.bob.peak: must be at least the rate of tier 'free' (20 tok/s): the "
        "peak is the ceiling above the rate that borrowing may reach",
    ],
    "peak_not_rate": [
        "FILE:4:9: default.peak: must be a number of tokens per second or 'unlimited' (got 'fast')",
    ],
    "peak_null": [
        f"FILE:6:29: users.alice.peak: {NO_PEAK}",
        f"FILE:9:10: users.bob.peak: {NO_PEAK}",
    ],
    "peak_on_unlimited": [
        "FILE:6:11: tiers.internal.peak: cannot be set on an unlimited rule: there is no rate "
        "to borrow above",
    ],
    "peak_on_unlimited_tier": [
        "FILE:6:45: match[0].peak: cannot be set here: tier 'internal' is unlimited, there is "
        "no rate to borrow above",
    ],
    "alias_bomb": [
        (
            "FILE:8:5: <root>: aliases expand to more than 10000 values beyond the file's own "
            "(alias bomb?)"
        ),
    ],
    "burst_negative": [
        "FILE:4:27: users.alice.burst: must be > 0",
    ],
    "burst_no_unit": [
        "FILE:3:8: burst: must be a duration like '100ms' or '0.25s', with a unit (got 5)",
    ],
    "burst_unparsable": [
        "FILE:4:27: tiers.pro.burst: must be a duration like '100ms' or '0.25s' (got 'soon')",
    ],
    "burst_zero": [
        "FILE:3:8: burst: must be > 0",
    ],
    "comments_only": [
        "FILE:1:1: <root>: empty policy; expected a mapping with 'version: 1' and 'default'",
    ],
    "default_missing": [
        (
            "FILE:1:1: default: missing; say what identified users not listed "
            "get (a number of tokens per second or 'unlimited')"
        ),
    ],
    "duplicate_key_nested": [
        "FILE:6:5: tiers.pro: duplicate key 'rate' (first at line 5)",
    ],
    "duplicate_key_root": [
        "FILE:3:1: <root>: duplicate key 'default' (first at line 2)",
    ],
    "duplicate_user": [
        "FILE:6:3: users: duplicate key 'alice' (first at line 4)",
    ],
    "empty": [
        "FILE:1:1: <root>: empty policy; expected a mapping with 'version: 1' and 'default'",
    ],
    "invalid_yaml": [
        (
            "FILE:5:6: <root>: invalid YAML: expected ',' or '}', but got ':' "
            "(while parsing a flow mapping at line 4)"
        ),
    ],
    "many_problems": [
        "FILE:2:10: default: must be > 0",
        "FILE:3:8: burst: must be a duration like '100ms' or '0.25s' (got 'soon')",
        (
            "FILE:5:10: users.alice: must be a number of tokens per second or "
            "'unlimited' (got 'fast')"
        ),
        "FILE:6:19: users.bob: unknown key 'max_stream' (did you mean 'max_streams'?)",
        "FILE:8:14: match[0].pattern: must not be empty",
        "FILE:9:11: match[0].tier: unknown tier 'gold' (no tiers are defined)",
    ],
    "match_not_list": [
        "FILE:4:3: match: must be a list (got a mapping)",
    ],
    "max_streams_negative": [
        "FILE:4:34: users.alice.max_streams: must be >= 1",
    ],
    "max_streams_not_int": [
        "FILE:6:18: match[0].max_streams: must be a whole number >= 1 (got 2.5)",
    ],
    "max_streams_zero": [
        "FILE:2:35: default.max_streams: must be >= 1",
    ],
    "merge_bomb": [
        (
            "FILE:22:3: <root>: aliases expand to more than 10000 values beyond the file's own "
            "(alias bomb?)"
        ),
    ],
    "nesting_too_deep": [
        "FILE:4:47: <root>: nested deeper than 32 levels (the limit)",
    ],
    "not_mapping_list": [
        "FILE:1:1: <root>: must be a mapping with 'version: 1' and 'default' (got a list)",
    ],
    "not_mapping_scalar": [
        (
            "FILE:1:1: <root>: must be a mapping with 'version: 1' and "
            "'default' (got 'just some text')"
        ),
    ],
    "null_limit": [
        (
            "FILE:4:9: users.alice: must be a number of tokens per second, "
            "'unlimited', or a mapping (got nothing)"
        ),
    ],
    "pattern_empty": [
        "FILE:6:14: match[1].pattern: must not be empty",
    ],
    "pattern_missing": [
        "FILE:4:5: match[0].pattern: missing; each match entry needs a 'pattern'",
    ],
    "pattern_too_long": [
        "FILE:4:15: match[0].pattern: pattern must be at most 256 characters (got 300)",
    ],
    "rate_bool": [
        ("FILE:4:10: users.alice: must be a number of tokens per second or 'unlimited' (got true)"),
    ],
    "rate_hex": [
        (
            "FILE:2:10: default: ambiguous number 0x10: YAML 1.1 reads it as hexadecimal (16); "
            "write it in decimal, or quote it if you meant text"
        ),
    ],
    "rate_inf": [
        "FILE:4:8: tiers.pro: must be a finite number; use 'unlimited' for no limit (got .inf)",
    ],
    "rate_nan": [
        "FILE:2:10: default: must be a finite number; use 'unlimited' for no limit (got .nan)",
    ],
    "rate_negative": [
        "FILE:4:17: users.alice.rate: must be > 0",
    ],
    "rate_or_tier_missing": [
        "FILE:4:10: users.carol: needs a 'rate' (tokens per second or 'unlimited') or a 'tier'",
    ],
    "rate_sexagesimal": [
        (
            "FILE:4:10: users.alice: ambiguous number 1:30: YAML 1.1 reads it as base 60 (90); "
            "write it in decimal, or quote it if you meant text"
        ),
    ],
    "rate_string": [
        (
            "FILE:4:10: users.alice: must be a number of tokens per second or "
            "'unlimited' (got 'fast')"
        ),
    ],
    "rate_too_large": [
        (
            "FILE:2:10: default: must be at most 1000000 tokens per second (use "
            "'unlimited' for no limit)"
        ),
    ],
    "rate_too_many_digits": [
        "FILE:2:10: default: must have at most 30 digits (got 31)",
    ],
    "rate_too_small": [
        (
            "FILE:4:10: users.alice: must be at least 0.000001 tokens per second (one token in "
            "about 12 days)"
        ),
    ],
    "rate_underflow": [
        (
            "FILE:4:10: users.alice: ambiguous number 1e-400: most YAML parsers read it as 0 (it "
            "is too small for a float); quote it if you meant text"
        ),
    ],
    "rate_with_tier": [
        (
            "FILE:6:28: users.carol.rate: cannot be set together with 'tier'; "
            "the tier brings its rate"
        ),
    ],
    "rate_zero": [
        "FILE:4:10: users.alice: must be > 0",
    ],
    "scalar_unreadable": [
        "FILE:2:10: default: cannot read '2024-99-99' as a date; quote it if you meant text",
        (
            "FILE:4:29: users.a.max_streams: cannot read "
            "'9999999999999999999999999999999999999...' as an integer; quote it if you meant text"
        ),
        "FILE:5:6: users.b: cannot read 'abc' as an integer; quote it if you meant text",
    ],
    "tier_name_not_string": [
        "FILE:2:17: default.tier: tier name must be a string; quote it: 'yes'",
        "FILE:4:3: tiers: tier name must be a string; quote it: 'on'",
    ],
    "tier_name_too_long": [
        "FILE:4:3: tiers: tier name must be at most 256 characters (got 300)",
    ],
    "tier_rate_missing": [
        (
            "FILE:4:8: tiers.pro.rate: missing; a tier needs a 'rate' (tokens "
            "per second or 'unlimited')"
        ),
    ],
    "tier_refers_tier": [
        (
            "FILE:5:9: tiers.pro: unknown key 'tier': a tier cannot refer to "
            "another tier; give it a 'rate'"
        ),
    ],
    "unknown_key_root": [
        "FILE:3:1: <root>: unknown key 'colour'",
    ],
    "unknown_key_suggest": [
        "FILE:4:18: users.bob: unknown key 'burts' (did you mean 'burst'?)",
    ],
    "unknown_tier": [
        "FILE:7:17: users.carol.tier: unknown tier 'gold' (defined tiers: free, pro)",
    ],
    "unknown_tier_none_defined": [
        "FILE:2:17: default.tier: unknown tier 'free' (no tiers are defined)",
    ],
    "user_id_control": [
        (
            "FILE:4:3: users: user id must not contain control characters (U+0009 at index 3): "
            "'bad\\tid'"
        ),
    ],
    "user_id_empty": [
        "FILE:4:3: users: user id must not be empty",
    ],
    "user_id_invisible": [
        (
            "FILE:5:3: users: user id must not contain control characters (U+0085 at index 1): "
            "'a\\x85b'"
        ),
        (
            "FILE:6:3: users: user id must not contain control characters (U+009B at index 1): "
            "'a\\x9bb'"
        ),
        (
            "FILE:7:3: users: user id must not contain format characters (U+202E at index 1): "
            "'a\\u202eb'"
        ),
        (
            "FILE:8:3: users: user id must not contain format characters (U+200B at index 3): "
            "'ali\\u200bce'"
        ),
        (
            "FILE:9:3: users: user id must not contain line separators (U+2028 at index 1): "
            "'a\\u2028b'"
        ),
        (
            "FILE:10:3: users: user id must not contain paragraph separators (U+2029 at index 1): "
            "'a\\u2029b'"
        ),
        "FILE:11:3: users: user id must not contain surrogates (U+D800 at index 1): 'a\\ud800b'",
    ],
    "user_id_not_string": [
        "FILE:4:3: users: user id must be a string; quote it: '12345'",
    ],
    "user_id_reserved": [
        (
            "FILE:4:3: users: '__anonymous__' is reserved for requests without "
            "identity; set their limit with the top-level 'anonymous' key"
        ),
    ],
    "user_id_too_long": [
        "FILE:4:3: users: user id must be at most 256 characters (got 257)",
    ],
    "user_id_yaml11": [
        "FILE:6:3: users: user id must be a string; quote it: '1.5'",
        "FILE:7:3: users: user id must be a string; quote it: '2024-01-01'",
        "FILE:8:3: users: user id must be a string; quote it: '~'",
        "FILE:9:3: users: user id must be a string; quote it: '0x10'",
        "FILE:10:3: users: user id must be a string; quote it: 'on'",
    ],
    "users_not_mapping": [
        "FILE:4:3: users: must be a mapping (got a list)",
    ],
    "version_2": [
        "FILE:1:10: version: unsupported version 2; this outrate reads version 1",
    ],
    "version_missing": [
        "FILE:1:1: version: missing; a policy file starts with 'version: 1'",
    ],
    "version_string": [
        "FILE:1:10: version: must be the number 1, not the string '1'",
    ],
    "yaml_tag": [
        (
            "FILE:2:10: <root>: invalid YAML: could not determine a constructor "
            "for the tag 'tag:yaml.org,2002:python/object:os.system'"
        ),
    ],
}


def test_every_fixture_has_expectations() -> None:
    assert sorted(p.stem for p in BAD.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_policy(name: str) -> None:
    path = BAD / f"{name}.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    expected = [line.replace("FILE", str(path)) for line in EXPECTED[name]]
    assert [str(p) for p in info.value.problems] == expected
    assert str(info.value) == "\n".join(expected)
    assert isinstance(info.value, OutrateError) and isinstance(info.value, ValueError)


def test_problems_are_sorted_by_position() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(BAD / "many_problems.yaml")
    positions = [(p.line, p.col) for p in info.value.problems]
    assert positions == sorted(positions)


def test_foreign_errors_are_chained() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(BAD / "invalid_yaml.yaml")
    assert info.value.__cause__ is not None
    with pytest.raises(PolicyError) as info:
        load_policy(BAD / "rate_zero.yaml")
    assert info.value.__cause__ is not None  # the pydantic ValidationError


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value) == f"{path}:1:1: <file>: cannot read: No such file or directory"
    assert isinstance(info.value.__cause__, OSError)


def test_unreadable_bytes(tmp_path: Path) -> None:
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"version: 1\ndefault: \xff\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value) == (
        f"{path}:1:1: <file>: cannot read: not UTF-8 text (invalid start byte at byte 20)"
    )


def test_directory_is_not_a_policy(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path)
    (problem,) = info.value.problems
    assert problem[:4] == (str(tmp_path), 1, 1, "<file>")
    assert problem.message.startswith("cannot read: ")


def test_accepts_pathlike_and_str(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\ndefault: 5\n")
    assert load_policy(path) == load_policy(os.fspath(path))


def _one(text: str) -> Problem:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    (problem,) = info.value.problems
    return problem


# -- values as written --------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "rate"),
    [
        ("100", Fraction(100)),
        ("0.1", Fraction(1, 10)),
        ("2.5", Fraction(5, 2)),
        ("1e3", Fraction(1000)),
        ("1.5e2", Fraction(150)),
        ("1/3", Fraction(1, 3)),
        ("1_000", Fraction(1000)),
        ("1000000", Fraction(1_000_000)),
        ("0.000001", Fraction(1, 1_000_000)),
        ("unlimited", UNLIMITED),
    ],
)
def test_rates_are_exact(written: str, rate: object) -> None:
    policy = parse_policy(f"version: 1\ndefault: {written}\n", "p.yaml")
    assert policy.default.rate == rate


@pytest.mark.parametrize(
    ("written", "ns"),
    [
        ("100ms", 100_000_000),
        ("0.25s", 250_000_000),
        ("2s", 2_000_000_000),
        ("1500us", 1_500_000),
        ("1500µs", 1_500_000),
        ("750ns", 750),
        ("3600s", 3_600_000_000_000),
    ],
)
def test_durations(written: str, ns: int) -> None:
    policy = parse_policy(f"version: 1\ndefault: 1\nburst: {written}\n", "p.yaml")
    assert policy.burst == ns


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("3601s", "must be at most 3600s"),
        ("0.5ns", "must be a whole number of nanoseconds"),
        ("-0s", "must be > 0"),
        ("5 min", "must be a duration like '100ms' or '0.25s' (got '5 min')"),
        ("true", "must be a duration like '100ms' or '0.25s', with a unit (got true)"),
    ],
)
def test_bad_durations(written: str, message: str) -> None:
    assert _one(f"version: 1\ndefault: 1\nburst: {written}\n") == Problem(
        "p.yaml", 3, 8, "burst", message
    )


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ('"-5"', "must be > 0"),
        ('"0x10"', "must be a number of tokens per second or 'unlimited' (got '0x10')"),
        ('"1e-400"', "must be at least 0.000001 tokens per second (one token in about 12 days)"),
        ('"nan"', "must be a number of tokens per second or 'unlimited' (got 'nan')"),
        (
            "1/0",
            "must be a number of tokens per second or 'unlimited' (got '1/0', a division by zero)",
        ),
        ("0/5", "must be > 0"),
        ("-.inf", "must be a finite number; use 'unlimited' for no limit (got -.inf)"),
        ("[1, 2]", "must be a number of tokens per second, 'unlimited', or a mapping (got a list)"),
        ("Unlimited", "must be a number of tokens per second or 'unlimited' (got 'Unlimited')"),
        ("2024-01-01", "must be a number of tokens per second or 'unlimited' (got 2024-01-01)"),
        ("1e7", "must be at most 1000000 tokens per second (use 'unlimited' for no limit)"),
    ],
)
def test_bad_rates(written: str, message: str) -> None:
    assert _one(f"version: 1\ndefault: {written}\n") == Problem("p.yaml", 2, 10, "default", message)


def test_anonymous_and_match_and_tiers_load() -> None:
    policy = parse_policy(
        "version: 1\n"
        "default: {tier: free}\n"
        "anonymous: 5\n"
        "tiers: {free: 20, pro: {rate: 500, burst: 250ms, max_streams: 8}}\n"
        "users: {carol: {tier: pro, max_streams: 2}}\n"
        "match:\n"
        "  - {pattern: 'team-x/*', tier: pro}\n"
        "  - {pattern: 'trial-*', rate: 10, max_streams: 2}\n",
        "p.yaml",
    )
    assert policy.users["carol"].tier == "pro" and policy.users["carol"].max_streams == 2
    assert [m.pattern for m in policy.match] == ["team-x/*", "trial-*"]
    assert policy.tiers["pro"].burst == 250_000_000
    assert policy.anonymous is not None and policy.anonymous.rate == 5
    assert policy.source == "p.yaml"
    assert policy.position("users", "carol") == (5, 16)
    assert policy.position("match", 1, "pattern") == (8, 15)


def test_peaks_load_on_every_kind_of_rule() -> None:
    policy = parse_policy(
        "version: 1\n"
        "default: {rate: 100, peak: 300}\n"
        "anonymous: {rate: 5, peak: 5}\n"
        "tiers: {free: {rate: 20, peak: 200}, pro: 500}\n"
        "users:\n"
        "  alice: {rate: 20, peak: unlimited}\n"
        "  bob: {tier: free}\n"
        "  carol: {tier: free, peak: '100/3'}\n"
        "  dave: {tier: pro, peak: 500.5}\n"
        "match:\n"
        "  - {pattern: 'trial-*', rate: 10, peak: 10.25, max_streams: 2}\n",
        "p.yaml",
    )
    assert policy.default.peak == 300
    assert policy.anonymous is not None and policy.anonymous.peak == 5  # = rate: allowed
    assert policy.tiers["free"].peak == 200 and policy.tiers["pro"].peak is None
    assert policy.users["alice"].peak == UNLIMITED
    assert policy.users["bob"].peak is None  # the tier's, resolved by the compiler
    assert policy.users["carol"].peak == Fraction(100, 3)
    assert policy.users["dave"].peak == Fraction(1001, 2)
    assert policy.match[0].peak == Fraction(41, 4)
    assert policy.position("match", 0, "peak") == (11, 42)


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("0", "must be > 0"),
        ("true", "must be a number of tokens per second or 'unlimited' (got true)"),
        ("[200]", "must be a number of tokens per second or 'unlimited' (got a list)"),
        ("1e7", "must be at most 1000000 tokens per second (use 'unlimited' for no limit)"),
        ("19.99", "must be at least the rate (20 tok/s): the peak is the ceiling above the "
         "rate that borrowing may reach"),
        ('"19.99"', "must be at least the rate (20 tok/s): the peak is the ceiling above the "
         "rate that borrowing may reach"),
        ("null", NO_PEAK),
        ("~", NO_PEAK),
    ],
)  # fmt: skip
def test_bad_peaks(written: str, message: str) -> None:
    problem = _one(f"version: 1\ndefault: 100\nusers:\n  alice: {{rate: 20, peak: {written}}}\n")
    assert problem == Problem("p.yaml", 4, 27, "users.alice.peak", message)


def test_an_empty_peak_is_an_error_not_no_peak() -> None:
    """Beside a tier, `peak:` with nothing used to keep the tier's peak."""
    text = "version: 1\ndefault: 100\ntiers: {t: {rate: 20, peak: 90}}\nusers:\n  a:\n"
    problem = _one(text + "    tier: t\n    peak:\n")
    assert problem == Problem("p.yaml", 7, 10, "users.a.peak", NO_PEAK)
    for spec in ("{rate: 5, peak: null}", "{tier: t, peak: ~}"):
        for where in ("default", "anonymous"):
            head = "version: 1\n" + ("" if where == "default" else "default: 1\n")
            (problem,) = _problems(f"{head}{where}: {spec}\ntiers: {{t: 20}}\n")
            assert problem.field == f"{where}.peak" and problem.message == NO_PEAK
    (problem,) = _problems("version: 1\ndefault: 1\ntiers: {t: {rate: 20, peak: null}}\n")
    assert problem.field == "tiers.t.peak" and problem.message == NO_PEAK


@pytest.mark.parametrize(
    ("quoted", "plain"),
    [('"200"', "200"), ('"2/3"', "2/3"), ('"unlimited"', "unlimited"), ("'0.1'", "0.1"),
     ('" 1e3 "', "1e3"), ("'+7'", "7"), ("'1_000'", "1_000"), ('"0.2_5"', "0.2_5")],
)  # fmt: skip
def test_a_rate_means_the_same_quoted_or_not(quoted: str, plain: str) -> None:
    """`peak: "200"` was refused while `peak: "2/3"` and `"unlimited"` were
    accepted: quotes change no rate now, as peak, as rate, everywhere."""

    def limits(written: str) -> tuple[object, ...]:
        policy = parse_policy(
            f"version: 1\ndefault: {written}\nanonymous: {{rate: 0.05, peak: {written}}}\n"
            f"tiers: {{t: {{rate: {written}}}}}\n"
            f"users:\n  a: {{rate: 0.05, peak: {written}}}\n  b: {written}\n",
            "p.yaml",
        )
        assert policy.anonymous is not None
        return (
            policy.default.rate, policy.anonymous.peak, policy.tiers["t"].rate,
            policy.users["a"].peak, policy.users["b"].rate,
        )  # fmt: skip

    assert limits(quoted) == limits(plain)


def test_a_quoted_rate_in_the_flags_json() -> None:
    """JSON can only quote: `{"a": {"rate": "20", "peak": "200"}}` as 20 and 200."""
    flags = policy_from_flags(None, '{"a": {"rate": "20", "peak": "200"}}')
    assert (flags.users["a"].rate, flags.users["a"].peak) == (20, 200)


def test_a_peak_below_its_tier_is_reported_with_every_other_problem() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(
            "version: 1\ndefault: 100\ntiers: {free: {rate: 20, peak: 40}}\n"
            "users:\n  bob: {tier: free, peak: 10}\n  carol: 0\n",
            "p.yaml",
        )
    assert [(p.line, p.field) for p in info.value.problems] == [
        (5, "users.bob.peak"),
        (6, "users.carol"),
    ]


def test_a_bad_tier_rate_is_reported_once_not_again_at_each_peak_above_it() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(
            "version: 1\ndefault: 100\ntiers: {free: fast}\n"
            "users:\n  bob: {tier: free, peak: 10}\n  dan: {tier: gold, peak: 10}\n",
            "p.yaml",
        )
    assert [p.field for p in info.value.problems] == ["tiers.free", "users.dan.tier"]


def test_merge_keys_and_anchors_work() -> None:
    policy = parse_policy(
        "version: 1\n"
        "default: &base {rate: 10, burst: 1s}\n"
        "users:\n"
        "  alice: *base\n"
        "  bob: {<<: *base, rate: 20}\n",
        "p.yaml",
    )
    assert policy.users["alice"] == policy.default
    assert policy.users["bob"].rate == 20 and policy.users["bob"].burst == 1_000_000_000


def test_duplicate_after_merge_is_allowed_but_explicit_duplicate_is_not() -> None:
    text = "version: 1\ndefault: &b {rate: 1}\nusers:\n  a: {<<: *b, rate: 2, rate: 3}\n"
    assert _one(text) == Problem(
        "p.yaml", 4, 24, "users.a", "duplicate key 'rate' (first at line 4)"
    )


def test_recursive_alias_is_an_error_not_a_hang() -> None:
    problems = pytest.raises(PolicyError, parse_policy, "version: 1\ndefault: &a [*a]\n", "p.yaml")
    assert "an alias refers to itself" in str(problems.value)


@pytest.mark.parametrize("loader_cls", LOADERS)
@pytest.mark.parametrize("name", ["alias_bomb", "merge_bomb"])
def test_alias_bombs_are_refused_within_a_few_megabytes(
    name: str, loader_cls: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """9^9 values from 500 bytes: refused after MAX_ALIAS_VALUES, not after a
    minute and gigabytes (the parse costs milliseconds; printed, not asserted)."""
    monkeypatch.setattr(compose, "FAST_LOADER", loader_cls)
    path = BAD / f"{name}.yaml"
    tracemalloc.start()
    began = time.perf_counter()
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    took = time.perf_counter() - began
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [str(p) for p in info.value.problems] == [
        line.replace("FILE", str(path)) for line in EXPECTED[name]
    ]
    print(
        f"{name} ({loader_cls.__name__}): refused in {took * 1000:.0f} ms, peak {peak / 1e6:.1f} MB"
    )
    assert peak < 8e6


def test_aliases_may_add_as_many_values_as_the_file_has() -> None:
    """Legitimate reuse: 2,000 users that are an alias of one limit, or any
    number of users that merge it (each merge copies its pairs, no more)."""
    head = "version: 1\ndefault: &base {rate: 10, burst: 1s}\nusers:\n"
    aliased = "".join(f"  u{i}: *base\n" for i in range(2_000))
    assert len(parse_policy(head + aliased, "p.yaml").users) == 2_000
    merged = "".join(f"  u{i}: {{<<: *base, max_streams: 2}}\n" for i in range(50_000))
    assert len(parse_policy(head + merged, "p.yaml").users) == 50_000


def test_keys_must_be_scalars() -> None:
    problem = _one("version: 1\ndefault: 1\nusers:\n  ? [a, b]\n  : 5\n")
    assert problem == Problem("p.yaml", 4, 5, "users", "keys must be plain scalars")


def test_non_string_root_key() -> None:
    assert _one("version: 1\ndefault: 1\n5: x\n") == Problem(
        "p.yaml", 3, 1, "<root>", "unknown key 5"
    )


def test_unsupported_collection_tag() -> None:
    assert _one("version: 1\ndefault: 1\nusers: !!set {a, b}\n") == Problem(
        "p.yaml", 3, 8, "users", "unsupported YAML tag 'tag:yaml.org,2002:set'"
    )


def test_multiple_documents_are_a_syntax_error() -> None:
    problem = _one("version: 1\ndefault: 1\n---\nversion: 1\n")
    assert problem.field == "<root>" and problem.message.startswith("invalid YAML: ")
    assert problem.line == 3


def test_odd_user_ids_are_quoted_in_field_paths() -> None:
    problem = _one('version: 1\ndefault: 1\nusers:\n  "a.b c": 0\n')
    assert problem == Problem("p.yaml", 4, 12, 'users."a.b c"', "must be > 0")


def test_field_path() -> None:
    assert field_path(()) == "<root>"
    assert field_path(("match", 1, "pattern")) == "match[1].pattern"
    assert field_path(("users", "team-x/bob", "rate")) == "users.team-x/bob.rate"
    assert field_path(("users", "")) == 'users.""'


def test_exact_decimal_from_yaml() -> None:
    policy = parse_policy("version: 1\ndefault: 0.1000000000000000000001\n", "p.yaml")
    assert policy.default.rate == Fraction(Decimal("0.1000000000000000000001"))


def test_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes("\ufeffversion: 1\ndefault: 3\n".encode())
    assert load_policy(path).default.rate == 3


@pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML built without libyaml here")
def test_same_results_without_libyaml(monkeypatch: pytest.MonkeyPatch) -> None:
    """libyaml is used when present; the pure-Python parser must agree exactly,
    positions included (Policy equality ignores them)."""
    assert compose.FAST_LOADER is not compose.PureLoader  # the comparison means something
    sources = [*BAD.glob("*.yaml"), *(BAD.parent.parent.parent / "policies").glob("*.yaml")]

    def outcome(path: Path) -> object:
        try:
            policy = load_policy(path)
            return policy, dict(policy._positions)
        except PolicyError as e:
            return e.problems

    fast = {p: outcome(p) for p in sources}
    monkeypatch.setattr(compose, "FAST_LOADER", compose.PureLoader)
    assert {p: outcome(p) for p in sources} == fast


# -- limits on nesting ----------------------------------------------------------

TOO_DEEP = "nested deeper than 32 levels (the limit)"


def _nested(depth: int) -> str:
    return "version: 1\ndefault: 1\nusers: {alice: " + "[" * depth + "]" * depth + "}\n"


@pytest.mark.parametrize("loader_cls", LOADERS)
@pytest.mark.parametrize("depth", [30, 31, 32, 500, 999, 1000, 5000, 200_000])
def test_deep_nesting_is_a_located_error_on_every_parser(
    depth: int, loader_cls: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flow nesting: libyaml refuses at 1000 levels itself, and PyYAML's own
    scanner and composer would recurse or take quadratic time; the limit is
    reported at the `[` where it was crossed (the 32nd flow level)."""
    monkeypatch.setattr(compose, "FAST_LOADER", loader_cls)
    text = _nested(depth)
    if depth <= 30:  # root and `users` are two levels: 32 in all
        assert _one(text).message.startswith("must be a number of tokens per second")
    elif depth == 31:  # level 33 is the 31st `[` (the composer sees it first)
        assert _one(text) == Problem("p.yaml", 3, 15 + 31, "<root>", TOO_DEEP)
    else:  # the scanner reads a run of `[` ahead: it stops at the 33rd flow level
        assert _one(text) == Problem("p.yaml", 3, 15 + 32, "<root>", TOO_DEEP)


@pytest.mark.parametrize("loader_cls", LOADERS)
def test_deep_block_nesting_is_located_at_its_first_level_too_deep(
    loader_cls: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compose, "FAST_LOADER", loader_cls)
    text = "version: 1\ndefault: 1\nusers:\n  alice:\n" + "".join(
        "    " + "  " * i + "- \n" for i in range(40)
    )
    # root, users, alice's list: depth 3 at line 5; depth 33 thirty lines on
    assert _one(text) == Problem("p.yaml", 35, 65, "<root>", TOO_DEEP)
    compact = "version: 1\ndefault: 1\nusers:\n  " + "- " * 2000 + "x\n"
    assert _one(compact) == Problem("p.yaml", 4, 3 + 31 * 2, "<root>", TOO_DEEP)


@pytest.mark.parametrize("loader_cls", LOADERS)
def test_nesting_through_aliases_counts(loader_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """20 levels written twice, one inside the other by an alias: 41 deep.
    Level 33 is the 12th `[` of the anchored list, reached through `y`."""
    monkeypatch.setattr(compose, "FAST_LOADER", loader_cls)
    text = (
        "version: 1\ndefault: 1\n"
        "x: &a " + "[" * 20 + "1" + "]" * 20 + "\n"
        "y: " + "[" * 20 + "*a" + "]" * 20 + "\n"
    )
    assert _one(text) == Problem("p.yaml", 3, 7 + 11, "<root>", TOO_DEEP)


@pytest.mark.parametrize("loader_cls", LOADERS)
def test_nesting_inside_a_complex_key_counts(
    loader_cls: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compose, "FAST_LOADER", loader_cls)
    text = "version: 1\ndefault: 1\nusers:\n  ? " + "[" * 40 + "]" * 40 + "\n  : 1\n"
    assert _one(text) == Problem("p.yaml", 4, 5 + 32, "<root>", TOO_DEEP)  # 33rd flow level


def test_no_recursion_error_whatever_the_nesting() -> None:
    """Mixed block and flow nesting at depths around every limit in play."""
    for depth in (30, 33, 300, 998, 1001, 3000):
        for opener, closer in (("[", "]"), ("{a: ", "}")):
            text = "version: 1\ndefault: " + opener * depth + "1" + closer * depth + "\n"
            with pytest.raises(PolicyError) as info:
                parse_policy(text, "p.yaml")
            assert "Recursion" not in str(info.value)


# -- YAML 1.1 spellings --------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "kind"),
    [
        ("1:30", "base 60 (90)"),
        ("1:30.5", "base 60 (90.5)"),
        ("0x10", "hexadecimal (16)"),
        ("-0x1F", "hexadecimal (-31)"),
        ("010", "octal (8)"),
        ("0b101", "binary (5)"),
        ("0x" + "f" * 40, "hexadecimal"),
    ],
)
def test_yaml11_only_numbers_are_ambiguous(written: str, kind: str) -> None:
    shown = written if len(written) <= 40 else written[:37] + "..."
    assert _one(f"version: 1\ndefault: {written}\n") == Problem(
        "p.yaml",
        2,
        10,
        "default",
        f"ambiguous number {shown}: YAML 1.1 reads it as {kind}; "
        "write it in decimal, or quote it if you meant text",
    )


@pytest.mark.parametrize("written", ["1e-400", "-1e-400", "1.0e-400", "0.5e-330", "1e-99999999999"])
def test_numbers_that_underflow_to_zero_are_ambiguous(written: str) -> None:
    assert _one(f"version: 1\ndefault: {written}\n").message == (
        f"ambiguous number {written}: most YAML parsers read it as 0 (it is too small "
        "for a float); quote it if you meant text"
    )


@pytest.mark.parametrize(
    ("written", "rate"),
    [("1_000", 1000), ("1e-6", Fraction(1, 10**6)), ("1e-323", None), ("0", None)],
)
def test_plain_decimal_spellings_are_not_ambiguous(written: str, rate: object) -> None:
    text = f"version: 1\ndefault: {written}\n"
    if rate is None:  # out of range, but not ambiguous
        assert not _one(text).message.startswith("ambiguous")
    else:
        assert parse_policy(text, "p.yaml").default.rate == rate


def test_huge_exponents_and_fractions_cost_nothing() -> None:
    """1e999999999 as an exact Fraction is a billion-digit integer."""
    for written, message in [
        ("1e999999999", "must be at most 1000000 tokens per second (use 'unlimited' for no limit)"),
        ("'1/" + "3" * 5000 + "'", "must have at most 30 digits (got 5000)"),
        ("0." + "1" * 5000, "must have at most 30 digits (got 5000)"),
    ]:
        assert _one(f"version: 1\ndefault: {written}\n").message == message


# -- names: their own position, the author's spelling, a length limit -----------


def test_every_key_error_is_at_its_own_key() -> None:
    text = "version: 1\ndefault: 1\nusers:\n  alice: 1\n  null: 2\n  3.0: 3\n  yes: 4\n"
    assert [(p.line, p.col, p.message) for p in _problems(text)] == [
        (5, 3, "user id must be a string; quote it: 'null'"),
        (6, 3, "user id must be a string; quote it: '3.0'"),
        (7, 3, "user id must be a string; quote it: 'yes'"),
    ]


def test_values_under_a_bad_key_are_located_under_it() -> None:
    problems = _problems("version: 1\ndefault: 1\nusers:\n  a: 1\n  1.5: {rate: 0}\n")
    assert [str(p) for p in problems] == [
        "p.yaml:5:3: users: user id must be a string; quote it: '1.5'",
        'p.yaml:5:15: users."1.5".rate: must be > 0',
    ]


def test_a_megabyte_name_gives_a_short_error_line() -> None:
    huge = "p" * 1_000_000
    for text in (
        f"version: 1\ndefault: 1\nmatch:\n  - {{pattern: '{huge}', rate: 0}}\n",
        f"version: 1\ndefault: 1\nusers:\n  {huge}: 0\n",
        f"version: 1\ndefault: {{tier: {huge}}}\n",
    ):
        problems = _problems(text)
        assert problems and all(len(str(p)) < 200 for p in problems), problems


def _problems(text: str) -> tuple[Problem, ...]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    return info.value.problems


def test_unknown_keys_are_shown_as_written() -> None:
    text = "version: 1\ndefault: {rate: 1, 1.5: 2}\n~: y\non: w\n5: v\n"
    assert [str(p) for p in _problems(text)] == [
        "p.yaml:2:20: default: unknown key 1.5",
        "p.yaml:3:1: <root>: unknown key ~",
        "p.yaml:4:1: <root>: unknown key on",
        "p.yaml:5:1: <root>: unknown key 5",
    ]


def test_a_long_spelling_is_cut_in_hints() -> None:
    problem = _one("version: 1\ndefault: 1\nusers:\n  " + "1" * 900 + ".5: 1\n")
    assert problem.message == f"user id must be a string; quote it: '{'1' * 37}...'"


@pytest.mark.parametrize(
    ("written", "what"),
    [
        ("!!int abc", "an integer"),
        ("!!float abc", "a number"),
        ("!!bool abc", "a boolean"),
        ("!!timestamp abc", "a date"),
        ("2024-02-30", "a date"),
    ],
)
def test_scalars_pyyaml_cannot_construct_are_located_errors(written: str, what: str) -> None:
    text = written.split()[-1]
    assert _one(f"version: 1\ndefault: {written}\n") == Problem(
        "p.yaml", 2, 10, "default", f"cannot read '{text}' as {what}; quote it if you meant text"
    )


@pytest.mark.parametrize(
    ("written", "found"),
    [
        ("{<<: 5}", "expected a mapping or list of mappings for merging, but found scalar"),
        ("{<<: [5]}", "expected a mapping for merging, but found scalar"),
    ],
)
def test_bad_merges_are_invalid_yaml(written: str, found: str) -> None:
    problem = _one(f"version: 1\ndefault: {written}\n")
    assert problem.message == f"invalid YAML: {found} (while constructing a mapping at line 2)"


def test_names_follow_the_identity_rules() -> None:
    text = (
        'version: 1\ndefault: 1\ntiers:\n  "p\\u200bro": 5\n'
        'match:\n  - {pattern: "a\\u202e*", rate: 1}\n'
    )
    assert [str(p) for p in _problems(text)] == [
        "p.yaml:4:3: tiers: tier name must not contain format characters (U+200B at index 1): "
        "'p\\u200bro'",
        "p.yaml:6:15: match[0].pattern: pattern must not contain format characters "
        "(U+202E at index 1): 'a\\u202e*'",
    ]


# -- prompt limits (issue 40) ---------------------------------------------------


def test_prompt_limits_load_on_every_kind_of_rule() -> None:
    policy = parse_policy(
        "version: 1\n"
        "default: {rate: 20, prompt: 2000}\n"
        "anonymous: {rate: 5, prompt: unlimited}\n"
        "tiers:\n"
        "  free: {rate: 20, prompt: {rate: 1000, burst: 1s, peak: unlimited}}\n"
        "users:\n"
        "  alice: {tier: free, prompt: 500}\n"
        "match:\n"
        "  - {pattern: 'trial-*', rate: 10, prompt: '1/2'}\n",
        "p.yaml",
    )
    assert policy.default.prompt is not None and policy.default.prompt.rate == 2000
    assert policy.anonymous is not None and policy.anonymous.prompt is not None
    assert policy.anonymous.prompt.rate == UNLIMITED
    free = policy.tiers["free"].prompt
    assert free is not None and free.peak == UNLIMITED and free.burst == 1_000_000_000
    assert policy.users["alice"].prompt is not None
    assert policy.match[0].prompt is not None and policy.match[0].prompt.rate == Fraction(1, 2)


@pytest.mark.parametrize(
    ("written", "col", "where", "message"),
    [
        ("0", 29, "prompt", "must be > 0"),
        ("-5", 29, "prompt", "must be > 0"),
        (".nan", 29, "prompt", "must be a finite number; use 'unlimited' for no limit (got .nan)"),
        (".inf", 29, "prompt", "must be a finite number; use 'unlimited' for no limit (got .inf)"),
        ("true", 29, "prompt",
         "must be a number of tokens per second or 'unlimited' (got true)"),
        ("fast", 29, "prompt",
         "must be a number of tokens per second or 'unlimited' (got 'fast')"),
        ("null", 29, "prompt", NO_PROMPT),
        ("{rate: 10, peak: 5}", 46, "prompt.peak",
         "must be at least the rate (10 tok/s): the peak is the ceiling above the rate that "
         "borrowing may reach"),
        ("{rate: unlimited, peak: 10}", 53, "prompt.peak",
         "cannot be set on an unlimited rule: there is no rate to borrow above"),
        ("{rate: 10, peek: 20}", 40, "prompt", "unknown key 'peek' (did you mean 'peak'?)"),
        ("{burst: 1s}", 29, "prompt.rate",
         "missing; a prompt limit needs a 'rate' (prompt tokens per second or 'unlimited')"),
    ],
)  # fmt: skip
def test_bad_prompt_limits(written: str, col: int, where: str, message: str) -> None:
    problem = _one(f"version: 1\ndefault: 100\nusers:\n  alice: {{rate: 20, prompt: {written}}}\n")
    assert problem == Problem("p.yaml", 4, col, f"users.alice.{where}", message)


# -- request rates and header styles (issue 41) ---------------------------------


def test_request_rates_load_on_every_kind_of_rule() -> None:
    policy = parse_policy(
        "version: 1\n"
        "default: {rate: 20, requests: 5}\n"
        "anonymous: {rate: 5, requests: '2/s'}\n"
        "headers: openai\n"
        "tiers:\n"
        "  free: {rate: 20, requests: 300/min}\n"
        "users:\n"
        "  alice: {tier: free, requests: unlimited}\n"
        "  bob: {rate: 10, requests: ' 7 / s '}\n"
        "match:\n"
        "  - {pattern: 'trial-*', rate: 10, requests: 1/min}\n",
        "p.yaml",
    )
    assert policy.default.requests == RequestRate(5, 1)
    assert policy.anonymous is not None and policy.anonymous.requests == RequestRate(2, 1)
    assert policy.tiers["free"].requests == RequestRate(300, 60)
    assert policy.users["alice"].requests == UNLIMITED
    assert policy.users["bob"].requests == RequestRate(7, 1)
    assert policy.match[0].requests == RequestRate(1, 60)
    assert policy.headers == "openai"
    assert parse_policy("version: 1\ndefault: 1\n", "p.yaml").headers == "both"


_NUMBER_OR_WINDOW = "must be a whole number of requests per second, 'N/s', 'N/min' or 'unlimited'"


@pytest.mark.parametrize(
    ("written", "col", "where", "message"),
    [
        ("0", 31, "requests", "must be > 0"),
        ("-5", 31, "requests", "must be > 0"),
        ("'0/min'", 31, "requests", "must be > 0"),
        ("'-3/s'", 31, "requests", "must be > 0"),
        ("2.5", 31, "requests",
         "must be a whole number of requests (got 2.5); for fewer than one a second write "
         "'N/min'"),
        (".nan", 31, "requests",
         "must be a finite number; use 'unlimited' for no limit (got .nan)"),
        (".inf", 31, "requests",
         "must be a finite number; use 'unlimited' for no limit (got .inf)"),
        ("true", 31, "requests", f"{_NUMBER_OR_WINDOW} (got true)"),
        ("lots", 31, "requests", f"{_NUMBER_OR_WINDOW} (got 'lots')"),
        ("'5 tok/s'", 31, "requests", f"{_NUMBER_OR_WINDOW} (got '5 tok/s')"),
        ("5rps", 31, "requests", f"{_NUMBER_OR_WINDOW} (got '5rps')"),
        ("[5]", 31, "requests", f"{_NUMBER_OR_WINDOW} (got a list)"),
        ("{rate: 5}", 31, "requests", f"{_NUMBER_OR_WINDOW} (got a mapping)"),
        ("5/h", 31, "requests",
         "unknown window 'h': write requests per '/s' or '/min' (hours and days are quotas, "
         "not rates) (got '5/h')"),
        ("5/day", 31, "requests",
         "unknown window 'day': write requests per '/s' or '/min' (hours and days are "
         "quotas, not rates) (got '5/day')"),
        ("5/ms", 31, "requests",
         "unknown window 'ms': write requests per '/s' or '/min' (got '5/ms')"),
        ("1000001", 31, "requests",
         "must be at most 1000000 requests per window (use 'unlimited' for no limit)"),
        ("1e400", 31, "requests",
         "must be at most 1000000 requests per window (use 'unlimited' for no limit)"),
        ("null", 31, "requests", NO_REQUESTS),
        ("5, reqests: 1", 34, "", "unknown key 'reqests' (did you mean 'requests'?)"),
    ],
)  # fmt: skip
def test_bad_request_rates(written: str, col: int, where: str, message: str) -> None:
    """Each bad request rate is one located error, with its own message."""
    text = f"version: 1\ndefault: 100\nusers:\n  alice: {{rate: 20, requests: {written}}}\n"
    field = f"users.alice.{where}" if where else "users.alice"
    assert _one(text) == Problem("p.yaml", 4, col, field, message)


@pytest.mark.parametrize("written", ["yes", "true", "IETF", "json", "null", "1"])
def test_bad_header_styles(written: str) -> None:
    problem = _one(f"version: 1\ndefault: 100\nheaders: {written}\n")
    assert problem.line == 3 and problem.col == 10 and problem.field == "headers"
    assert problem.message.startswith("must be 'both', 'ietf', 'openai' or 'off' (got ")


@pytest.mark.parametrize("written", ["off", "'off'", "false", "Off"])
def test_headers_off_is_off_however_yaml_reads_it(written: str) -> None:
    assert parse_policy(f"version: 1\ndefault: 1\nheaders: {written}\n", "p.yaml").headers == "off"


# -- token quotas (issue 41 item 3) ----------------------------------------------


def test_quotas_load_and_inherit_like_requests() -> None:
    from outrate.budget.quota import Quota
    from outrate.policy.compiler import compile_policy

    policy = parse_policy(
        "version: 1\n"
        "default: {rate: 20, quota: {output: 2M/day, prompt: 50M/day}}\n"
        "tiers:\n"
        "  free: {rate: 5, quota: {output: '1.5K/hour'}}\n"
        "users:\n"
        "  alice: {tier: free}\n"
        "  bob: {tier: free, quota: unlimited}\n"
        "  carol: {tier: free, quota: {prompt: 1_000/week}}\n"
        "  dave: {rate: 1, quota: {output: 3G/month}}\n",
        "p.yaml",
    )
    compiled = compile_policy(policy, "p.yaml")
    assert compiled.default.quotas == (
        Quota("output", 2_000_000, "day"),
        Quota("prompt", 50_000_000, "day"),
    )
    assert compiled.anonymous.quotas == compiled.default.quotas  # one bucket at the default
    assert compiled.limit_for("alice").quotas == (Quota("output", 1500, "hour"),)
    assert compiled.limit_for("bob").quotas == ()
    assert compiled.limit_for("carol").quotas == (Quota("prompt", 1000, "week"),)
    assert compiled.limit_for("dave").quotas == (Quota("output", 3 * 10**9, "month"),)


_QUOTA_FORM = (
    "must be a number of tokens per window like '2M/day' (per 'hour', 'day', 'week' or 'month')"
)
_WINDOWS = "write tokens per 'hour', 'day', 'week' or 'month'"


@pytest.mark.parametrize(
    ("written", "col", "where", "message"),
    [
        ("{output: 0/day}", 37, "quota.output", "must be > 0"),
        ("{output: -5/day}", 37, "quota.output", "must be > 0"),
        ("{prompt: '-1M/week'}", 37, "quota.prompt", "must be > 0"),
        ("{output: 2M/s}", 37, "quota.output",
         f"unknown window 's': {_WINDOWS} (seconds and minutes are rates: 'rate', 'prompt', "
         "'requests') (got '2M/s')"),
        ("{output: 2M/h}", 37, "quota.output",
         f"unknown window 'h': {_WINDOWS} (did you mean 'hour'?) (got '2M/h')"),
        ("{output: 2M/fortnight}", 37, "quota.output",
         f"unknown window 'fortnight': {_WINDOWS} (got '2M/fortnight')"),
        ("{output: 5 tok/day}", 37, "quota.output",
         "unknown unit 'tok': write a number of tokens with K, M or G (thousands, millions, "
         "billions) or none (got '5 tok/day')"),
        ("{output: lots}", 37, "quota.output", f"{_QUOTA_FORM} (got 'lots')"),
        ("{output: true}", 37, "quota.output", f"{_QUOTA_FORM} (got true)"),
        ("{output: 5}", 37, "quota.output",
         "needs a window: write '5/day' (per 'hour', 'day', 'week' or 'month') (got 5)"),
        ("{output: .inf}", 37, "quota.output",
         "must be a finite number of tokens per window (got .inf)"),
        ("{output: 2000G/day}", 37, "quota.output",
         "must be at most 1000000000000 tokens per window (1000G); leave 'quota' out for no "
         "quota"),
        ("{output: 0.5/day}", 37, "quota.output",
         "must be a whole number of tokens (got '0.5/day')"),
        ("{}", 28, "quota",
         "names no quota: write 'output' and/or 'prompt' (like {output: 2M/day}), or "
         "'unlimited'"),
        ("null", 28, "quota",
         "must be a mapping like {output: 2M/day}, or 'unlimited' (got nothing): leave "
         "'quota' out for the default (none, or the tier's)"),
        ("2M/day", 28, "quota",
         "must be a mapping like {output: 2M/day, prompt: 50M/day}, or 'unlimited' "
         "(got '2M/day')"),
        ("{output: 2M/day, outptu: 1}", 45, "quota",
         "unknown key 'outptu' (did you mean 'output'?)"),
    ],
)  # fmt: skip
def test_bad_quotas(written: str, col: int, where: str, message: str) -> None:
    """Each bad quota is one located error, with its own message."""
    text = f"version: 1\ndefault: 100\nusers:\n  alice: {{rate: 20, quota: {written}}}\n"
    assert _one(text) == Problem("p.yaml", 4, col, f"users.alice.{where}", message)
