"""Lint rules: a policy that loads can still be a mistake, and a vLLM deployment
can make any policy unenforceable. `outrate lint` and the engine at startup run
the same rules, so what lint accepts is what the engine accepts.

Codes are stable (tools and CI filter on them); never renumber, only add:

- OR000 error    the policy does not load (each problem, with its location)
- OR001 warning  a burst shorter than an engine step
- OR002 warning  a tier nobody refers to
- OR003 warning  a match pattern that can never match (shadowed by an earlier one)
- OR004 warning  a match pattern without wildcards (an exact user id)
- OR005 warning  anonymous requests unlimited while identified users are limited
- OR006 warning  two user ids that look alike (equal after NFKC and case folding)
- OR007 warning  identity source api_key with a keys file that lists no key
- OR008 warning  a user id that is also a rule's metrics label (default, tier:NAME, ...)
- OR009 warning  a user id with whitespace at an end (`alice `): no request can carry it
- OR010 warning  anonymous requests borrow without a cap (peak unlimited) while an
                 identified user's borrowing is capped
- OR011 warning  rules that cap output but leave prompts unlimited (one line)
- OR012 warning  a committed rate so high that no engine step is short enough for
                 it while some rule has a peak: its steps lend nothing
- OR101 error    speculative decoding
- OR102 error    data parallel size > 1 without a budget store (--outrate-store)
- OR103 error    pipeline parallel size > 1
- OR104 error    a KV connector
- OR105 error    an EC (encoder cache) connector
- OR106 error    KV offloading
- OR107 error    auxiliary outputs (routed experts) through the aux-output connector
- OR108 error    a scheduler class other than outrate's
- OR109 error    a model kind outrate cannot limit
- OR111 warning  --max-num-active-seqs unset or not below --max-num-seqs
- OR112 warning  chunked prefill disabled
- OR113 warning  identity source body on a server other clients can reach
- OR114 error    identity source api_key together with vLLM's own --api-key
- OR115 warning  --outrate-store-fallback full: N engines may give N x the rate while
                 the store is down
- OR116 warning  --outrate-store without --outrate-store-engines (and no data parallel):
                 an engine started while the store is unreachable enforces the full rate
- OR117 warning  --outrate-store-fallback share: the deprecated name of pause
- OR118 error    chunked prefill off and a prompt limit whose burst holds fewer
                 tokens than max_model_len (checked where --max-model-len is known)
- OR119 error    --outrate-store with a prompt limit and chunked prefill off
- OR120 warning  a request rate (`requests:`) with more than one API server and no
                 --outrate-store: each keeps its own table, so a user may get up to
                 N x its request rate
"""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from outrate.budget.gcra import PEAK_UNLIMITED
from outrate.check.deployment import Deployment
from outrate.check.lending import unlendable_rates
from outrate.check.prompts import open_prompts_message, open_prompts_rules, prompt_refusals
from outrate.check.quotas import quota_refusals
from outrate.check.rules import Finding, lint_deployment, lint_exposure
from outrate.errors import PolicyError, Problem
from outrate.identity.core import padding_error
from outrate.policy.compiler import CompiledPolicy, compile_policy, is_rule_label
from outrate.policy.model import LimitRule, Policy
from outrate.policy.pipeline import load_compiled
from outrate.policy.values import shown
from outrate.units import format_duration

SHORT_BURST_NS = 50_000_000
"""An engine step under load takes tens of milliseconds on most GPUs."""


# -- policy rules -------------------------------------------------------------


class _Where:
    """Turns field paths into `path:line:col` when the policy came from a file."""

    def __init__(self, policy: Policy | None, source: str) -> None:
        self.policy = policy
        self.source = source

    def __call__(self, *path: Any) -> str:
        while self.policy is not None and path:
            pos = self.policy.position(*path)
            if pos is not None:
                return f"{self.source}:{pos[0]}:{pos[1]}"
            path = path[:-1]
        return self.source


def _short_burst(ns: int) -> str:
    return (
        f"burst {format_duration(ns)} is shorter than an engine step on most GPUs "
        "(50 ms or more under load): budget that accrues between two steps beyond "
        "the burst is lost, so users get less than their rate"
    )


def _burst_findings(
    policy: Policy | None, compiled: CompiledPolicy, where: _Where
) -> list[Finding]:
    out = []
    if policy is None:  # a hand-built CompiledPolicy: check what it resolved to
        limits = [compiled.default, compiled.anonymous, *compiled.users.values()]
        limits += [*compiled.tiers.values(), *(lim for _, lim in compiled.patterns)]
        seen: set[int] = set()
        for lim in limits:
            if lim.rate is not None and lim.burst_ns < SHORT_BURST_NS and id(lim) not in seen:
                seen.add(id(lim))
                out.append(
                    Finding(
                        "OR001", "warning", f"{lim.rule}: {_short_burst(lim.burst_ns)}", where()
                    )
                )
        return out
    if policy.burst < SHORT_BURST_NS:
        out.append(Finding("OR001", "warning", _short_burst(policy.burst), where("burst")))
    for path, rule in policy.rules():
        if rule.burst is not None and rule.burst < SHORT_BURST_NS and rule.rate != "unlimited":
            out.append(Finding("OR001", "warning", _short_burst(rule.burst), where(*path, "burst")))
    return out


def _tier_findings(policy: Policy, where: _Where) -> list[Finding]:
    used = {r.tier for _, r in policy.rules() if isinstance(r, LimitRule) and r.tier}
    return [
        Finding(
            "OR002",
            "warning",
            f"tier '{name}' is defined but nothing refers to it (no user, match entry, "
            "default or anonymous), so its limit applies to nobody",
            where("tiers", name),
        )
        for name in policy.tiers
        if name not in used
    ]


_GLOB = re.compile(r"[*?\[]")


def _pattern_findings(policy: Policy, where: _Where) -> list[Finding]:
    """OR003/OR004 in one pass: each pattern meets a dict of those before it,
    the first all-'*' one, and (literal ids only) the globs before it."""
    out = []
    first_at: dict[str, int] = {}
    star: int | None = None
    globs: list[tuple[int, str]] = []
    for j, rule in enumerate(policy.match):
        later = rule.pattern
        literal = _GLOB.search(later) is None
        earliest = [i for i in (first_at.get(later), star) if i is not None]
        if literal:
            earliest += [next((i for i, g in globs if fnmatchcase(later, g)), j)]
        i = min(earliest, default=j)
        if i < j:
            out.append(
                Finding(
                    "OR003",
                    "warning",
                    f"pattern '{later}' can never match: match[{i}] '{policy.match[i].pattern}' "
                    "comes first and matches every id it would (first match wins)",
                    where("match", j, "pattern"),
                )
            )
        elif literal:
            out.append(
                Finding(
                    "OR004",
                    "warning",
                    f"pattern '{later}' has no wildcard (*, ?, [...]) so it matches "
                    "one user id only; list that user under 'users' instead",
                    where("match", j, "pattern"),
                )
            )
        first_at.setdefault(later, j)
        if star is None and set(later) == {"*"}:
            star = j
        if not literal:
            globs.append((j, later))
    return out


def _anonymous_finding(
    policy: Policy | None, compiled: CompiledPolicy, where: _Where
) -> list[Finding]:
    if compiled.anonymous.rate is not None:
        return []
    others = [compiled.default, *compiled.users.values(), *(lim for _, lim in compiled.patterns)]
    if all(lim.rate is None for lim in others):
        return []
    written = policy is not None and policy.anonymous is not None
    how = (
        "'anonymous' is unlimited"
        if written
        else "'anonymous' is not set and the default is unlimited"
    )
    return [
        Finding(
            "OR005",
            "warning",
            f"requests without a user id are unlimited ({how}) while identified users "
            "are limited: a client escapes its limit by sending no user id; set "
            "'anonymous' to a rate",
            where("anonymous") if written else where("default"),
        )
    ]


def _anonymous_peak_finding(
    policy: Policy | None, compiled: CompiledPolicy, where: _Where
) -> list[Finding]:
    """OR005 one level up: the shared anonymous budget may borrow without a cap
    while some identified user may not, so a client escapes its peak (or its
    rate, where it has no peak) by sending no user id."""
    anonymous = compiled.anonymous
    if anonymous.peak != PEAK_UNLIMITED or anonymous.shadow:
        return []
    others = [compiled.default, *compiled.users.values(), *(lim for _, lim in compiled.patterns)]
    if all(lim.rate is None or lim.peak == PEAK_UNLIMITED for lim in others):
        return []
    written = policy is not None and policy.anonymous is not None
    how = "'anonymous' has" if written else "'anonymous' is not set and the default has"
    return [
        Finding(
            "OR010",
            "warning",
            f"requests without a user id may borrow idle capacity without a cap ({how} "
            "peak: unlimited) while identified users' borrowing is capped: a client gets "
            "more by sending no user id; give 'anonymous' a finite peak",
            where("anonymous", "peak") if written else where("default", "peak"),
        )
    ]


def _lookalike_findings(policy: Policy, where: _Where) -> list[Finding]:
    """`alice` and `Alice`, or `ｂｏｂ` (fullwidth) and `bob`: a reader (and a
    gateway that folds case) takes them for one user; outrate keeps two budgets."""
    first: dict[str, str] = {}
    out = []
    for uid in policy.users:
        folded = unicodedata.normalize("NFKC", uid).casefold()
        seen = first.setdefault(folded, uid)
        if seen != uid:
            out.append(
                Finding(
                    "OR006",
                    "warning",
                    f"user id {shown(uid)} looks like {shown(seen)} ({where('users', seen)}): "
                    "they are equal after Unicode NFKC normalization and case folding, "
                    "but are two users with two budgets",
                    where("users", uid),
                )
            )
    return out


def _padding_findings(policy: Policy, where: _Where) -> list[Finding]:
    """`alice ` or `alice\u00a0` under `users:`: requests with such an id are
    refused (400) and a header loses its spaces, so the entry limits nobody,
    while the author thinks alice is limited. A warning, not an error: such
    policies loaded before the rule, and must keep loading."""
    out = []
    for uid in policy.users:
        bad = padding_error(uid)
        if bad is not None:
            out.append(
                Finding(
                    "OR009",
                    "warning",
                    f"user id {shown(uid)} {bad}: no request can carry it (a header loses "
                    "its spaces and tabs, any other id with whitespace at an end is refused "
                    "with 400), so this limit applies to nobody; remove the whitespace",
                    where("users", uid),
                )
            )
    return out


def _label_findings(policy: Policy, where: _Where) -> list[Finding]:
    """A listed user's metrics series is labelled with its id: `default` or
    `tier:gold` would be added into that rule's series."""
    return [
        Finding(
            "OR008",
            "warning",
            f"user id {shown(uid)} is also the metrics label of a rule "
            "(default, anonymous, other, tier:NAME or match:PATTERN): its series and "
            "the rule's add up in one; rename the user",
            where("users", uid),
        )
        for uid in policy.users
        if is_rule_label(uid)
    ]


def _keys_finding(compiled: CompiledPolicy, where: _Where) -> list[Finding]:
    identity = compiled.identity
    if identity.source != "api_key" or identity.keys is None or len(identity.keys):
        return []
    return [
        Finding(
            "OR007",
            "warning",
            f"the keys file {identity.keys_file} lists no key: every request will be "
            "refused with 401 (add one with `outrate keys add USER --file "
            f"{identity.keys_file}`)",
            where("identity", "keys"),
        )
    ]


def _prompt_finding(compiled: CompiledPolicy, where: _Where) -> list[Finding]:
    """OR011, one line for the policy: the hole of a prompt flood (a user
    inside its output rate fills every step with prefill)."""
    rules = open_prompts_rules(compiled)
    if not rules:
        return []
    names = [name for _, name in rules]
    first = rules[0][0]
    return [Finding("OR011", "warning", open_prompts_message(names), where(*first))]


def lint_policy(compiled_or_policy: CompiledPolicy | Policy) -> list[Finding]:
    """Warnings about a policy that loads but probably does not do what was meant."""
    if isinstance(compiled_or_policy, CompiledPolicy):
        compiled = compiled_or_policy
        policy = compiled.policy
        source = compiled.source
    else:
        policy = compiled_or_policy
        source = policy.source or "<policy>"
        compiled = compile_policy(policy, source)
    where = _Where(policy, source)
    out = _burst_findings(policy, compiled, where)
    if policy is not None:
        out += _tier_findings(policy, where)
        out += _pattern_findings(policy, where)
        out += _lookalike_findings(policy, where)
        out += _padding_findings(policy, where)
        out += _label_findings(policy, where)
    out += _anonymous_finding(policy, compiled, where)
    out += _anonymous_peak_finding(policy, compiled, where)
    out += _keys_finding(compiled, where)
    out += _prompt_finding(compiled, where)
    return out


# -- everything at once ---------------------------------------------------------


@dataclass(frozen=True)
class LintReport:
    """What `outrate lint` prints and the engine checks at startup."""

    source: str
    policy: CompiledPolicy | None
    """None when the policy did not load; then `problems` says why."""
    problems: tuple[Problem, ...]
    findings: tuple[Finding, ...]

    @property
    def loaded(self) -> bool:
        return self.policy is not None

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    def ok(self, strict: bool = False) -> bool:
        """No errors (and, with `strict`, no warnings either)."""
        return not self.errors and not (strict and self.warnings)

    def to_json(self, strict: bool = False) -> dict[str, Any]:
        return {
            "ok": self.ok(strict),
            "findings": [f._asdict() for f in self.findings],
            "policy": self.policy.summary() if self.policy is not None else None,
            "shadow": self.shadow,
        }

    @property
    def shadow(self) -> list[str]:
        """Rules computed and counted but not enforced (shadow mode)."""
        return self.policy.shadow_rules if self.policy is not None else []


def lint_all(
    policy_path: str | os.PathLike[str], deployment: Deployment | None = None
) -> LintReport:
    """Load, compile and lint a policy, and lint the deployment if one is given.

    A policy that fails to load yields one OR000 finding per problem, so every
    consumer sees one list; `problems` keeps them in their exact loader form.
    """
    source = os.fspath(policy_path)
    findings: list[Finding] = []
    compiled: CompiledPolicy | None = None
    problems: tuple[Problem, ...] = ()
    try:
        compiled = load_compiled(source)
    except PolicyError as e:
        problems = e.problems
        findings += [
            Finding("OR000", "error", f"{p.field}: {p.message}", f"{p.path}:{p.line}:{p.col}")
            for p in e.problems
        ]
    if compiled is not None:
        findings += lint_policy(compiled)
        seqs = deployment.max_num_seqs if deployment is not None else None
        findings += unlendable_rates(compiled, seqs)
    if deployment is not None:
        findings += lint_deployment(deployment)
        if compiled is not None:
            findings += lint_exposure(compiled.identity, deployment)
            refused = prompt_refusals(
                compiled, deployment.store, deployment.chunked_prefill, deployment.max_model_len
            )
            refused += quota_refusals(
                compiled, deployment.store, deployment.quota_file, deployment.data_parallel_size
            )
            findings += [
                Finding(code, "error", f"{p.field}: {p.message}", f"{p.path}:{p.line}:{p.col}")
                for code, p in refused
            ]
            findings += _api_servers_finding(compiled, deployment)
    return LintReport(source, compiled, problems, tuple(findings))


def _api_servers_finding(compiled: CompiledPolicy, deployment: Deployment) -> list[Finding]:
    """OR120: request rates are decided in each API server process on its own
    (docs/client-contract.md), unless a store shares them (`--outrate-store`)."""
    if deployment.store:
        return []
    count = deployment.api_server_count
    if count is None:
        count = max(1, deployment.data_parallel_size)  # vLLM's default: one per rank
    rules = request_rules(compiled)
    if count <= 1 or not rules:
        return []
    names = ", ".join(rules[:5]) + (f" and {len(rules) - 5} more" if len(rules) > 5 else "")
    return [
        Finding(
            "OR120",
            "warning",
            f"{count} API servers each keep their own request table: a user whose "
            f"connections reach all of them may get up to {count} x its request rate "
            f"({names}); run one API server where the request rate must be exact",
            deployment.where("api_server_count"),
        )
    ]


def request_rules(compiled: CompiledPolicy) -> list[str]:
    """The rules with an enforced request rate (`default`, `users.alice`, ...)."""
    seen: dict[str, None] = {}
    for lim in compiled.all_limits():
        req = lim.requests
        if req is not None and req.rate is not None and not req.shadow:
            seen.setdefault(req.rule.removesuffix(".requests"))
    return list(seen)
