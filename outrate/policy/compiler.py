"""`Policy` -> `CompiledPolicy`: what the scheduler asks on every new user.

A loaded policy is resolved once into shared `Limit` objects (one per rule, not
per user or lookup), so `limit_for` is a dict lookup for listed users and a
bounded cache in front of the ordered patterns for everyone else. Compiling a
policy the loader accepted cannot fail: every value was checked there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import translate
from fractions import Fraction
from types import MappingProxyType
from typing import Any

from outrate.budget.gcra import PEAK_UNLIMITED, per_window
from outrate.budget.limiter import Limit
from outrate.identity.core import ANONYMOUS, BODY, IdentityConfig, KeyTable
from outrate.policy.model import LimitRule, Policy, TierRule
from outrate.policy.specs import PromptRule
from outrate.policy.values import UNLIMITED, RequestRate
from outrate.units import format_count, format_rate

PATTERN_CACHE_SIZE = 65_536
"""Pattern results remembered per policy; bounded so hostile ids cannot grow it."""


@dataclass(frozen=True, slots=True, eq=False)
class CompiledPolicy:
    """An immutable, resolved policy. Swapped whole on reload, never edited.

    `_cache` is the one mutable part: a private, bounded memo of pattern
    matches. Only the scheduler thread calls `limit_for`, and losing the cache
    (clearing when full) only costs a re-match, never a different answer.
    """

    source: str
    default: Limit
    anonymous: Limit
    burst_ns: int
    users: Mapping[str, Limit] = field(default_factory=dict)
    tiers: Mapping[str, Limit] = field(default_factory=dict)
    patterns: tuple[tuple[str, Limit], ...] = ()
    policy: Policy | None = field(default=None, repr=False)
    """The validated policy this came from, for lint and `outrate` tooling."""
    sha256: str = ""
    """Hex digest of the exact bytes compiled (file) or of the flags' JSON:
    what `outrate_policy_info` and the reloader compare."""
    per_user_series: tuple[str, ...] = ()
    """Globs of users who get Prometheus series of their own (`metrics.per_user`)."""
    max_series: int = 1000
    identity: IdentityConfig = BODY
    """The `identity:` section, with the keys file's table when it was loaded."""
    headers: str = "both"
    """Which rate-limit header fields guarded responses carry (`headers:`)."""
    _series_matchers: tuple[Any, ...] = field(init=False, repr=False)
    _lookup: dict[str, Limit] = field(init=False, repr=False)
    _matchers: tuple[tuple[Any, Limit], ...] = field(init=False, repr=False)
    _cache: dict[str, Limit] = field(init=False, repr=False, default_factory=dict)
    prompts: PromptSource = field(init=False, repr=False)
    """What the prompt budgets' table asks (a `LimitSource`): each user's prompt limit."""
    requests: RequestSource = field(init=False, repr=False)
    """What the API server's request table asks (a `LimitSource`): each user's request rate."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", PromptSource(self))
        object.__setattr__(self, "requests", RequestSource(self))
        lookup = dict(self.users)
        object.__setattr__(self, "_lookup", lookup)
        object.__setattr__(self, "users", MappingProxyType(lookup))
        object.__setattr__(self, "tiers", MappingProxyType(dict(self.tiers)))
        object.__setattr__(self, "patterns", tuple(self.patterns))
        matchers = tuple((re.compile(translate(p)).match, lim) for p, lim in self.patterns)
        object.__setattr__(self, "_matchers", matchers)
        series = tuple(re.compile(translate(p)).match for p in self.per_user_series)
        object.__setattr__(self, "_series_matchers", series)

    @property
    def depends_on(self) -> tuple[str, ...]:
        """Files besides the policy that it was built from (the keys file)."""
        keys = self.identity.keys
        return (keys.source,) if keys is not None and keys.source else ()

    @property
    def fingerprint(self) -> str:
        """The policy's sha256, then each file it depends on: what the reloader
        compares to tell whether anything it was built from changed."""
        keys = self.identity.keys
        return self.sha256 + (f"+{keys.sha256}" if self.depends_on and keys else "")

    def wants_series(self, user_id: str) -> bool:
        """Whether `user_id` is counted under its own id in metrics (listed users
        and `metrics.per_user` globs), cap permitting; else under its rule."""
        if user_id in self._lookup:
            return True
        return any(match(user_id) is not None for match in self._series_matchers)

    def limit_for(self, user_id: str) -> Limit:
        """The limit of `user_id`: exact user, then first matching pattern, then
        default. `ANONYMOUS` is the shared budget of requests without identity."""
        limit = self._lookup.get(user_id)
        if limit is not None:
            return limit
        if user_id == ANONYMOUS:
            return self.anonymous
        if not self._matchers:
            return self.default
        cache = self._cache
        limit = cache.get(user_id)
        if limit is not None:
            return limit
        limit = self.default
        for match, candidate in self._matchers:
            if match(user_id) is not None:
                limit = candidate
                break
        if len(cache) >= PATTERN_CACHE_SIZE:
            cache.clear()
        cache[user_id] = limit
        return limit

    @property
    def is_unlimited(self) -> bool:
        """True iff no rule limits anything (rate or streams): the engine can then
        behave exactly like stock vLLM."""
        limits = [self.default, self.anonymous, *self.users.values(), *self.tiers.values()]
        limits += [lim for _, lim in self.patterns]
        return all(
            (lim.rate is None and lim.max_streams is None and lim.prompt is None) or lim.shadow
            for lim in limits
        )

    def all_limits(self) -> list[Limit]:
        """Every limit a user can resolve to (the scheduler asks whether any lends)."""
        limits = [self.default, self.anonymous, *self.tiers.values(), *self.users.values()]
        return limits + [lim for _, lim in self.patterns]

    @property
    def prompt_rules(self) -> list[str]:
        """Rules whose prompt tokens are limited (a finite prompt rate), in
        shadow or not: the scheduler paces prefill only when there is one."""
        seen: dict[str, None] = {}
        for lim in self.all_limits():
            if lim.prompt is not None and lim.prompt.rate is not None:
                seen.setdefault(lim.rule)
        return list(seen)

    @property
    def shadow_rules(self) -> list[str]:
        """Rules computed and counted but not enforced (for lint and logs)."""
        limits = [self.default, self.anonymous, *self.tiers.values(), *self.users.values()]
        limits += [lim for _, lim in self.patterns]
        seen: dict[str, None] = {}
        for lim in limits:
            if lim.shadow and lim.rate is not None:
                seen.setdefault(lim.rule)
        return list(seen)

    @property
    def peak_rules(self) -> list[str]:
        """Rules that may borrow above their rate, with their peak
        (`users.alice peak unlimited`), for lint and logs."""
        limits = [self.default, self.anonymous, *self.tiers.values(), *self.users.values()]
        limits += [lim for _, lim in self.patterns]
        seen: dict[str, None] = {}
        for lim in limits:
            if lim.peak is not None:
                seen.setdefault(f"{lim.rule} peak {peak_text(lim.peak)}")
        return list(seen)

    def summary(self) -> str:
        """One line for logs and `outrate lint`; rules with a peak are named
        (five, then how many more)."""
        counts = ", ".join(
            format_count(n, word)
            for n, word in (
                (len(self.users), "user"),
                (len(self.tiers), "tier"),
                (len(self.patterns), "pattern"),
            )
        )
        identity = (
            "" if self.identity.source == "body" else f"; identity {self.identity.describe()}"
        )
        # default's and anonymous's peaks too: the list is where a reader looks
        # for who borrows (they also show in their own descriptions)
        peaks = self.peak_rules
        if len(peaks) > _SUMMARY_PEAKS:
            peaks = [*peaks[:_SUMMARY_PEAKS], f"... and {len(peaks) - _SUMMARY_PEAKS} more"]
        borrowing = f"; borrowing: {', '.join(peaks)}" if peaks else ""
        return (
            f"outrate policy from {self.source}: {counts}; "
            f"default {self.default.describe()}; anonymous {self.anonymous.describe()}"
            f"{borrowing}{identity}"
        )


_SUMMARY_PEAKS = 5
"""Rules with a peak named in the summary line; the rest are counted."""


class PromptSource:
    """A compiled policy seen by the prompt budgets' table: `limit_for` answers
    each user's prompt limit (the rule's `Limit.prompt`), unlimited when its
    rule has none. One per `CompiledPolicy`, so a reload swaps both tables."""

    __slots__ = ("policy",)

    def __init__(self, policy: CompiledPolicy) -> None:
        self.policy = policy

    def limit_for(self, user_id: str) -> Limit:
        prompt = self.policy.limit_for(user_id).prompt
        return UNLIMITED_PROMPT if prompt is None else prompt


UNLIMITED_PROMPT = Limit(None, 1, rule="prompt unlimited", label="")
"""The prompt limit of a rule without one (no state, no pacing)."""


class RequestSource:
    """A compiled policy seen by the API server's request table: `limit_for`
    answers each user's request rate (the rule's `Limit.requests`), unlimited
    when its rule has none."""

    __slots__ = ("policy",)

    def __init__(self, policy: CompiledPolicy) -> None:
        self.policy = policy

    def limit_for(self, user_id: str) -> Limit:
        requests = self.policy.limit_for(user_id).requests
        return UNLIMITED_REQUESTS if requests is None else requests


UNLIMITED_REQUESTS = Limit(None, 1, rule="requests unlimited", label="")
"""The request rate of a rule without one (no state)."""


def peak_text(peak: Fraction | str) -> str:
    """A Limit's peak as logs and lint show it: `200`, `unlimited`."""
    return "unlimited" if peak == PEAK_UNLIMITED else format_rate(Fraction(peak))


def _limit(
    rule: TierRule | LimitRule,
    name: str,
    label: str,
    policy: Policy,
    tier_limits: Mapping[str, Limit],
) -> Limit:
    """One rule -> one Limit. Inheritance: the rule's own burst/max_streams/shadow/peak,
    then its tier's, then the policy's burst and mode (no peak: no borrowing)."""
    shadow = rule.shadow
    if isinstance(rule, LimitRule) and rule.tier is not None:
        base = policy.tiers[rule.tier]
        overrides = (
            rule.burst,
            rule.max_streams,
            rule.shadow,
            rule.peak,
            rule.prompt,
            rule.requests,
            rule.quota,
        )
        if all(value is None for value in overrides):
            return tier_limits[rule.tier]  # shared: same rule as the tier
        rate = base.rate
        burst = rule.burst or base.burst or policy.burst
        streams = rule.max_streams if rule.max_streams is not None else base.max_streams
        peak = rule.peak if rule.peak is not None else base.peak
        prompt = rule.prompt if rule.prompt is not None else base.prompt
        requests = rule.requests if rule.requests is not None else base.requests
        quota = rule.quota if rule.quota is not None else base.quota
        if shadow is None:
            shadow = base.shadow
        name = f"{name} (tiers.{rule.tier})"
    else:
        rate = rule.rate if rule.rate is not None else UNLIMITED
        burst = rule.burst or policy.burst
        streams = rule.max_streams
        peak = rule.peak
        prompt = rule.prompt
        requests = rule.requests
        quota = rule.quota
    if shadow is None:
        shadow = policy.mode == "shadow"
    return Limit(
        None if rate == UNLIMITED else rate,
        burst,
        streams,
        rule=name,
        shadow=shadow,
        label=label,
        peak=PEAK_UNLIMITED if peak == UNLIMITED else peak,
        prompt=_prompt_limit(prompt, name, label, shadow, policy),
        requests=_requests_limit(requests, name, label, shadow),
        quotas=() if quota is None else quota.quotas(),
    )


def _requests_limit(
    rate: RequestRate | str | None, name: str, label: str, shadow: bool
) -> Limit | None:
    """A rule's request rate as a GCRA limit (`per_window`); None: unlimited."""
    if not isinstance(rate, RequestRate):
        return None
    return per_window(rate.count, rate.window_s, f"{name}.requests", label, shadow)


def _prompt_limit(
    rule: PromptRule | None, name: str, label: str, shadow: bool, policy: Policy
) -> Limit | None:
    """A rule's prompt limit: its own burst, else the policy's; the rule's
    shadow and label. None: prompts unlimited (no state)."""
    if rule is None or rule.rate == UNLIMITED:
        return None
    peak = rule.peak
    return Limit(
        rule.rate,
        rule.burst or policy.burst,
        rule=f"{name}.prompt",
        shadow=shadow,
        label=label,
        peak=PEAK_UNLIMITED if peak == UNLIMITED else peak,
    )


def compile_identity(policy: Policy, keys: KeyTable | None = None) -> IdentityConfig:
    """The `identity:` section; `keys` is the keys file's table, loaded by the
    pipeline (the compiler reads no files)."""
    section = policy.identity
    if section.source == "body":
        return BODY
    return IdentityConfig(
        source=section.source,
        header=section.header.lower() if section.header else None,
        on_claim_mismatch=section.on_claim_mismatch or "reject",
        keys=keys if section.source == "api_key" else None,
    )


RULE_LABELS = ("default", "anonymous", "other")
"""Metrics labels of the rules themselves (`other`: users past the series cap);
tiers are `tier:NAME` and patterns `match:PATTERN`."""


def is_rule_label(user_id: str) -> bool:
    """Whether `user_id`, as a metrics label, would be read as a rule's label
    (a user named `default` or `tier:gold` would share that rule's series)."""
    return user_id in RULE_LABELS or user_id.startswith(("tier:", "match:"))


def compile_policy(
    policy: Policy, source: str, sha256: str = "", keys: KeyTable | None = None
) -> CompiledPolicy:
    """Resolve a validated policy into shared Limits. Never fails on a loaded
    policy: tier references and every value were checked by the loader."""
    tier_limits = {
        name: _limit(rule, f"tiers.{name}", f"tier:{name}", policy, {})
        for name, rule in policy.tiers.items()
    }

    def resolve(rule: TierRule | LimitRule, name: str, label: str) -> Limit:
        return _limit(rule, name, label, policy, tier_limits)

    default = resolve(policy.default, "default", "default")
    if policy.anonymous is not None:
        anonymous = resolve(policy.anonymous, "anonymous", "anonymous")
    else:  # one shared bucket at the default limit
        d = default
        anonymous = Limit(
            d.rate,
            d.burst_ns,
            d.max_streams,
            rule="anonymous (default)",
            shadow=d.shadow,
            label="anonymous",
            peak=d.peak,
            prompt=d.prompt,
            requests=d.requests,
            quotas=d.quotas,
        )
    return CompiledPolicy(
        source=source,
        default=default,
        anonymous=anonymous,
        burst_ns=policy.burst,
        users={uid: resolve(rule, f"users.{uid}", uid) for uid, rule in policy.users.items()},
        tiers=tier_limits,
        patterns=tuple(
            (m.pattern, resolve(m, f"match[{i}] {m.pattern}", f"match:{m.pattern}"))
            for i, m in enumerate(policy.match)
        ),
        policy=policy,
        sha256=sha256,
        per_user_series=policy.metrics.per_user,
        max_series=policy.metrics.max_series,
        identity=compile_identity(policy, keys),
        headers=policy.headers,
    )


__all__ = ["CompiledPolicy", "compile_identity", "compile_policy", "is_rule_label", "peak_text"]
