"""Compiler: resolution order, shared Limits, the bounded pattern cache, flags."""

from __future__ import annotations

import dataclasses
from fnmatch import fnmatchcase
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outrate.budget.gcra import PEAK_UNLIMITED
from outrate.budget.limiter import Limit, Limiter
from outrate.errors import PolicyError
from outrate.identity.core import ANONYMOUS
from outrate.policy import compiler
from outrate.policy.compiler import compile_policy
from outrate.policy.loader import parse_policy
from outrate.policy.model import Policy
from outrate.policy.pipeline import load_compiled, policy_from_flags

POLICIES = Path(__file__).parent.parent / "policies"

TIERS = """\
version: 1
default: {tier: free}
anonymous: 10
burst: 200ms
tiers:
  free: 20
  pro: {rate: 500, burst: 250ms, max_streams: 8}
users:
  alice: 50
  bob: {rate: 2.5, burst: 1s}
  carol: {tier: pro}
  dave: {tier: pro, max_streams: 2}
  erin: {tier: pro}
  frank: unlimited
match:
  - pattern: "team-x/*"
    tier: pro
  - pattern: "trial-*"
    rate: 10
    max_streams: 2
  - pattern: "team-*"
    rate: 30
"""


def compiled(text: str = TIERS, source: str = "t.yaml") -> compiler.CompiledPolicy:
    return compile_policy(parse_policy(text, source), source)


def test_resolution_order() -> None:
    c = compiled()
    assert c.limit_for("alice").rate == 50  # exact user
    assert c.limit_for("team-x/zed") is c.tiers["pro"]  # first match wins...
    assert c.limit_for("team-y").rule == "match[2] team-*"  # ...over later ones
    assert c.limit_for("trial-1").max_streams == 2
    assert c.limit_for("nobody") is c.default and c.default.rule == "tiers.free"
    assert c.limit_for(ANONYMOUS) is c.anonymous
    assert c.anonymous.rate == 10


def test_rules_and_inheritance() -> None:
    c = compiled()
    ms = 1_000_000
    assert c.burst_ns == 200 * ms
    assert (c.users["alice"].rule, c.users["alice"].burst_ns) == ("users.alice", 200 * ms)
    assert c.users["bob"].rate == Fraction(5, 2) and c.users["bob"].burst_ns == 1000 * ms
    # a tier reference without overrides is the tier's own Limit (one per rule)
    assert c.users["carol"] is c.tiers["pro"] is c.users["erin"]
    assert c.tiers["pro"].rule == "tiers.pro"
    # with overrides it is its own rule, inheriting the rest from the tier
    dave = c.users["dave"]
    assert (dave.rate, dave.burst_ns, dave.max_streams) == (500, 250 * ms, 2)
    assert dave.rule == "users.dave (tiers.pro)"
    assert c.users["frank"].rate is None
    assert c.default is c.tiers["free"] and c.default.burst_ns == 200 * ms
    assert c.patterns[0] == ("team-x/*", c.tiers["pro"])


PEAKS = """\
version: 1
default: {rate: 100, peak: 300}
tiers:
  free: {rate: 20, peak: 200, max_streams: 4}
  pro: 500
users:
  alice: {rate: 20, peak: unlimited}
  bob: {tier: free}
  carol: {tier: free, peak: 20}
  dave: {tier: free, max_streams: 2}
  erin: {tier: pro, peak: 1000}
  frank: {rate: 20, peak: 20}
  gina: {rate: 20}
match:
  - {pattern: "trial-*", rate: 10, peak: 25}
"""


def test_peaks_pass_through_and_inherit_like_burst_and_max_streams() -> None:
    c = compiled(PEAKS)
    assert c.default.peak == 300 and c.default.excess == Limit(200, c.burst_ns)
    assert c.users["alice"].peak == PEAK_UNLIMITED
    assert c.users["alice"].excess is not None and c.users["alice"].excess.rate is None
    free = c.tiers["free"]
    assert (free.peak, free.max_streams) == (200, 4)
    assert c.users["bob"] is free  # no override: the tier's own Limit, peak included
    # a peak of its own overrides the tier's; equal to the rate: no borrowing
    carol = c.users["carol"]
    assert (carol.rule, carol.peak, carol.excess, carol.max_streams) == (
        "users.carol (tiers.free)",
        None,
        None,
        4,
    )
    assert c.users["dave"].peak == 200  # another override keeps the tier's peak
    assert (c.users["erin"].rate, c.users["erin"].peak) == (500, 1000)
    assert c.users["frank"] == c.users["gina"]  # peak = rate is no peak at all
    assert c.limit_for("trial-1").peak == 25
    assert c.limit_for("trial-1").excess == Limit(15, c.burst_ns)


def test_anonymous_at_the_default_borrows_like_the_default() -> None:
    c = compiled("version: 1\ndefault: {rate: 7, peak: unlimited}\n")
    assert c.anonymous == c.default and c.anonymous.peak == PEAK_UNLIMITED
    c = compiled("version: 1\ndefault: {rate: 7, peak: unlimited}\nanonymous: 5\n")
    assert c.anonymous.peak is None


def test_no_peak_compiles_exactly_as_before() -> None:
    c = compiled()  # TIERS has no peak
    limits = [c.default, c.anonymous, *c.users.values(), *c.tiers.values()]
    assert all(
        lim.peak is None and lim.excess is None for lim in limits + [p for _, p in c.patterns]
    )
    assert c.peak_rules == []


def test_summary_names_the_rules_that_borrow() -> None:
    c = compiled(PEAKS, "p")
    assert c.peak_rules == [
        "default peak 300",
        "anonymous (default) peak 300",
        "tiers.free peak 200",
        "users.alice peak unlimited",
        "users.dave (tiers.free) peak 200",
        "users.erin (tiers.pro) peak 1000",
        "match[0] trial-* peak 25",
    ]
    assert c.summary() == (
        "outrate policy from p: 7 users, 2 tiers, 1 pattern; "
        "default 100 tok/s burst 100ms peak 300; anonymous 100 tok/s burst 100ms peak 300; "
        "borrowing: default peak 300, anonymous (default) peak 300, tiers.free peak 200, "
        "users.alice peak unlimited, users.dave (tiers.free) peak 200, ... and 2 more"
    )
    # Issue 42: default and anonymous are listed whenever they have a peak.
    c = compiled("version: 1\ndefault: 100\nanonymous: {rate: 10, peak: 50}\n", "p")
    assert c.summary().endswith(
        "anonymous 10 tok/s burst 100ms peak 50; borrowing: anonymous peak 50"
    )
    many = "".join(f"  u{i}: {{rate: 1, peak: {i + 2}}}\n" for i in range(7))
    c = compiled(f"version: 1\ndefault: 5\nusers:\n{many}", "p")
    assert c.summary().endswith(
        "borrowing: users.u0 peak 2, users.u1 peak 3, users.u2 peak 4, users.u3 peak 5, "
        "users.u4 peak 6, ... and 2 more"
    )


def test_flags_may_carry_a_peak() -> None:
    c = policy_from_flags(10, '{"u": {"rate": 5, "peak": "unlimited"}}')
    assert c.users["u"].peak == PEAK_UNLIMITED and c.default.peak is None


def test_limits_are_shared_per_rule_not_per_lookup() -> None:
    c = compiled()
    assert c.limit_for("team-a") is c.limit_for("team-b")
    assert c.limit_for("x1") is c.limit_for("x2") is c.default
    assert c.limit_for("alice") is c.limit_for("alice")


def test_anonymous_defaults_to_one_bucket_at_the_default() -> None:
    c = compiled("version: 1\ndefault: {rate: 7, max_streams: 3}\n")
    assert c.anonymous == c.default
    assert c.anonymous.rule == "anonymous (default)"
    assert c.limit_for(ANONYMOUS) is c.anonymous


def test_compiled_policy_is_immutable() -> None:
    c = compiled()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.default = c.anonymous  # type: ignore[misc]
    with pytest.raises(TypeError):
        c.users["mallory"] = c.default  # type: ignore[index]
    with pytest.raises(TypeError):
        c.tiers["gold"] = c.default  # type: ignore[index]
    assert isinstance(c.patterns, tuple)
    assert not hasattr(c, "__dict__")  # slots


def test_pattern_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "PATTERN_CACHE_SIZE", 100)
    c = compiled()
    for i in range(1000):
        assert c.limit_for(f"team-{i}").rate == 30
        assert len(c._cache) <= 100
    assert c.limit_for("team-x/a") is c.tiers["pro"]


def test_no_patterns_no_cache() -> None:
    c = compiled("version: 1\ndefault: 5\n")
    for i in range(100):
        c.limit_for(f"u{i}")
    assert c._cache == {}


def test_summary() -> None:
    c = load_compiled(POLICIES / "seed.yaml")
    assert c.summary() == (
        f"outrate policy from {POLICIES / 'seed.yaml'}: 2 users, 0 tiers, 0 patterns; "
        "default 100 tok/s burst 100ms; anonymous 100 tok/s burst 100ms"
    )
    one = compiled("version: 1\ndefault: unlimited\nusers: {a: 1}\ntiers: {t: 2}\n", "x")
    assert one.summary() == (
        "outrate policy from x: 1 user, 1 tier, 0 patterns; default unlimited; anonymous unlimited"
    )


def test_is_unlimited() -> None:
    assert compiled("version: 1\ndefault: unlimited\n").is_unlimited
    assert compiled("version: 1\ndefault: unlimited\nusers: {a: unlimited}\n").is_unlimited
    assert not compiled("version: 1\ndefault: unlimited\nusers: {a: 5}\n").is_unlimited
    assert not compiled("version: 1\ndefault: unlimited\nanonymous: 5\n").is_unlimited
    assert not compiled("version: 1\ndefault: {rate: unlimited, max_streams: 4}\n").is_unlimited
    assert not compiled("version: 1\ndefault: unlimited\ntiers: {t: 5}\n").is_unlimited
    assert policy_from_flags(None, None).is_unlimited


def test_every_loaded_policy_compiles_and_drives_a_limiter() -> None:
    for path in sorted(POLICIES.glob("*.yaml")):
        c = load_compiled(path)
        assert c.source == str(path) and c.policy is not None
        limiter = Limiter(c, clock=lambda: 0)
        assert limiter.try_take("someone", now=0)
        assert limiter.try_take(ANONYMOUS, now=0)


# -- flags ----------------------------------------------------------------------


def test_flags_like_the_seed() -> None:
    c = policy_from_flags(100, '{"user-a": 100, "user-b": 500}')
    assert c.source == "flags"
    assert c.limit_for("user-b").rate == 500 and c.limit_for("zz") is c.default
    assert c.default.rate == 100 and c.anonymous.rate == 100
    assert c.summary() == load_compiled(POLICIES / "seed.yaml").summary().replace(
        str(POLICIES / "seed.yaml"), "flags"
    )


def test_flags_without_default_are_unlimited() -> None:
    c = policy_from_flags(None, {"user-a": 0.5})
    assert c.default.rate is None
    assert c.limit_for("user-a").rate == Fraction(1, 2)


def test_flag_floats_are_exact() -> None:
    c = policy_from_flags(0.1, '{"u": 0.3}')
    assert c.default.rate == Fraction(1, 10) and c.users["u"].rate == Fraction(3, 10)


@pytest.mark.parametrize(
    ("default", "users", "message"),
    [
        (0, None, "--default-user-output-tokens-per-second:1:1: default: must be > 0"),
        (-1.5, None, "--default-user-output-tokens-per-second:1:1: default: must be > 0"),
        (
            2e6,
            None,
            "--default-user-output-tokens-per-second:1:1: default: must be at most 1000000 "
            "tokens per second (use 'unlimited' for no limit)",
        ),
        (None, '{"user-a": 0}', "--user-output-tokens-per-second:1:1: users.user-a: must be > 0"),
        (None, {"user-a": -3}, "--user-output-tokens-per-second:1:1: users.user-a: must be > 0"),
        (
            None,
            '{"user-a": "fast"}',
            "--user-output-tokens-per-second:1:1: users.user-a: must be a number of tokens "
            "per second or 'unlimited' (got 'fast')",
        ),
        (
            None,
            '{"__anonymous__": 5}',
            "--user-output-tokens-per-second:1:1: users: '__anonymous__' is reserved for "
            "requests without identity; set their limit with the top-level 'anonymous' key",
        ),
        (
            None,
            "[1, 2]",
            "--user-output-tokens-per-second:1:1: users: must be a JSON object of user id "
            "-> tokens per second",
        ),
        (
            None,
            "{bad",
            "--user-output-tokens-per-second:1:2: users: invalid JSON: Expecting property "
            "name enclosed in double quotes",
        ),
        (
            None,
            "[" * 100_000 + "]" * 100_000,  # json.loads recurses once per level
            "--user-output-tokens-per-second:1:1: users: invalid JSON: nested too deep",
        ),
        (
            None,
            '{"a": ' + "[" * 900 + "]" * 900 + "}",  # parses; nothing after it may recurse
            "--user-output-tokens-per-second:1:1: users.a: must be a number of tokens per "
            "second, 'unlimited', or a mapping (got a list)",
        ),
    ],
)
def test_bad_flags(default: float | None, users: object, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_flags(default, users)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_both_flags_bad_reports_both() -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_flags(0, '{"a": 0}')
    assert [p.path for p in info.value.problems] == [
        "--default-user-output-tokens-per-second",
        "--user-output-tokens-per-second",
    ]


# -- properties -------------------------------------------------------------------

ids = st.text(alphabet="abx-/*?", min_size=1, max_size=6)
globs = st.text(alphabet="abx-/*?", min_size=1, max_size=4)


@given(
    users=st.dictionaries(ids, st.integers(1, 1000), max_size=5),
    patterns=st.lists(st.tuples(globs, st.integers(1, 1000)), max_size=5),
    probe=ids,
)
def test_limit_for_follows_the_documented_order(
    users: dict[str, int], patterns: list[tuple[str, int]], probe: str
) -> None:
    policy = Policy.model_validate(
        {
            "version": 1,
            "default": 1,
            "users": users,
            "match": [{"pattern": p, "rate": r} for p, r in patterns],
        }
    )
    c = compile_policy(policy, "prop")
    got = c.limit_for(probe)
    if probe in users:
        assert got.rule == f"users.{probe}" and got.rate == users[probe]
    else:
        first = next((i for i, (p, _) in enumerate(patterns) if fnmatchcase(probe, p)), None)
        if first is None:
            assert got is c.default
        else:
            assert got is c.patterns[first][1]
            assert got.rule == f"match[{first}] {patterns[first][0]}"
    assert c.limit_for(probe) is got  # the cache answers the same


peaks = st.one_of(st.none(), st.just("unlimited"), st.integers(0, 9 * 10**5))
"""None: no peak; an int: how far above the rate it sits."""


@given(st.integers(1, 10**5), peaks, st.integers(1, 10**5), peaks)
def test_compile_never_fails_on_a_loaded_peak(
    rate: int, peak: int | str | None, tier_rate: int, override: int | str | None
) -> None:
    def above(base: int, peak: int | str | None) -> dict[str, object]:
        return {} if peak is None else {"peak": peak if isinstance(peak, str) else base + peak}

    data = {
        "version": 1,
        "default": {"rate": rate, **above(rate, peak)},
        "tiers": {"t": {"rate": tier_rate, **above(tier_rate, peak)}},
        "users": {"u": {"tier": "t", **above(tier_rate, override)}},
    }
    c = compile_policy(Policy.model_validate(data), "p")
    expected = override if override is not None else peak
    u = c.users["u"]
    if expected is None or expected == 0:
        assert u.peak is None
    else:
        assert u.peak == (PEAK_UNLIMITED if expected == "unlimited" else tier_rate + expected)


@given(st.dictionaries(ids, st.integers(1, 10**6), max_size=20))
def test_compile_never_fails_on_a_loaded_policy(users: dict[str, int]) -> None:
    c = compile_policy(Policy.model_validate({"version": 1, "default": 1, "users": users}), "p")
    assert all(isinstance(v, Limit) for v in c.users.values())
    assert len(c.users) == len(users)


# -- prompt limits (issue 40) ---------------------------------------------------


def test_prompt_limits_compile_with_inheritance() -> None:
    from outrate.policy.compiler import UNLIMITED_PROMPT, compile_policy
    from outrate.policy.loader import parse_policy

    policy = compile_policy(
        parse_policy(
            "version: 1\nburst: 200ms\ndefault: {rate: 20, prompt: 2000}\n"
            "tiers:\n  free: {rate: 20, prompt: {rate: 1000, burst: 1s}}\n"
            "users:\n  alice: {tier: free}\n  bob: {tier: free, prompt: 500}\n"
            "  carol: {tier: free, prompt: unlimited}\n  dave: 30\n",
            "p.yaml",
        ),
        "p.yaml",
    )
    d = policy.default.prompt
    assert d is not None and d.rate == 2000 and d.burst_ns == 200_000_000
    assert d.rule == "default.prompt" and d.label == "default"
    alice = policy.limit_for("alice").prompt
    assert alice is not None and alice.rate == 1000 and alice.burst_ns == 1_000_000_000
    bob = policy.limit_for("bob").prompt
    assert bob is not None and bob.rate == 500
    assert policy.limit_for("carol").prompt is None
    assert policy.limit_for("dave").prompt is None
    assert policy.prompts.limit_for("dave") is UNLIMITED_PROMPT
    assert policy.prompts.limit_for("bob") is bob
    assert policy.anonymous.prompt is d  # the default's, shared
    assert "default.prompt" not in policy.prompt_rules and "default" in policy.prompt_rules
    assert "users.dave" not in policy.prompt_rules
    assert "prompt 2000 tok/s" in policy.default.describe()


def test_a_prompt_edit_changes_the_limit() -> None:
    from outrate.policy.compiler import compile_policy
    from outrate.policy.loader import parse_policy

    def build(prompt: str) -> object:
        text = f"version: 1\ndefault: {{rate: 20, prompt: {prompt}}}\n"
        return compile_policy(parse_policy(text, "p.yaml"), "p.yaml").default

    assert build("500") == build("500")
    assert build("500") != build("600")


# -- request rates (issue 41) ---------------------------------------------------


def test_request_rates_inherit_like_prompt_limits() -> None:
    from outrate.budget.gcra import burst_count, per_window_text

    policy = compile_policy(
        parse_policy(
            "version: 1\n"
            "default: {rate: 20, requests: 5}\n"
            "tiers:\n"
            "  t: {rate: 50, requests: 300/min}\n"
            "users:\n"
            "  a: {tier: t}\n"
            "  b: {tier: t, requests: unlimited}\n"
            "  c: {rate: 1}\n",
            "p.yaml",
        ),
        "p.yaml",
    )
    a = policy.requests.limit_for("a")
    assert (burst_count(a), per_window_text(a), a.rule) == (300, "300/min", "tiers.t.requests")
    assert policy.requests.limit_for("b").rate is None  # overridden: unlimited
    assert policy.requests.limit_for("c").rate is None  # no rule of its own, no tier
    anon = policy.requests.limit_for(ANONYMOUS)  # anonymous not set: the default's
    assert per_window_text(anon) == "5/s" and anon.label == "default"
    assert "requests 5/s" in policy.default.describe()
