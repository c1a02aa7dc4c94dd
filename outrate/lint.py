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
- OR113 warning  --outrate-store-fallback full: N engines may give N x the rate while
                 the store is down
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal, NamedTuple

from outrate.compiler import CompiledPolicy, compile_policy
from outrate.deployment import Deployment
from outrate.errors import PolicyError, Problem
from outrate.pipeline import load_compiled
from outrate.policy import LimitRule, Policy, _shown
from outrate.units import format_duration

Severity = Literal["error", "warning"]

SHORT_BURST_NS = 50_000_000
"""An engine step under load takes tens of milliseconds on most GPUs."""

OFFLOAD_CONNECTORS = frozenset(
    {"OffloadingConnector", "SimpleCPUOffloadConnector", "LMCacheMPConnector"}
)
"""Connectors vLLM 0.32 installs itself for --kv-offloading-size (reported as OR106)."""

REJECTED_MODEL_KINDS = {
    "multimodal": "encoder inputs are scheduled under a separate encoder budget that "
    "the per-user limiter does not see",
    "encoder-decoder": "encoder steps are scheduled outside the decoder path the limiter charges",
    "hybrid": "hybrid (attention + state-space) models keep per-request state whose "
    "preemption and caching outrate's scheduler does not handle",
    "attention-free": "state-space models keep per-request state whose preemption "
    "and caching outrate's scheduler does not handle",
    "diffusion": "diffusion language models produce a canvas of tokens per step, "
    "so charging one token per sampling step would not match what users receive",
}


class Finding(NamedTuple):
    """One lint result. `location` is `path:line:col`, a flag, or a source name."""

    code: str
    severity: Severity
    message: str
    location: str

    def __str__(self) -> str:
        return f"{self.location}: {self.code} {self.severity}: {self.message}"


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
    out = []
    patterns = [m.pattern for m in policy.match]
    for j, later in enumerate(patterns):
        literal = _GLOB.search(later) is None
        for i, earlier in enumerate(patterns[:j]):
            if (
                earlier == later
                or set(earlier) == {"*"}
                or (literal and fnmatchcase(later, earlier))
            ):
                out.append(
                    Finding(
                        "OR003",
                        "warning",
                        f"pattern '{later}' can never match: match[{i}] '{earlier}' "
                        "comes first and matches every id it would (first match wins)",
                        where("match", j, "pattern"),
                    )
                )
                break
        else:
            if literal:
                out.append(
                    Finding(
                        "OR004",
                        "warning",
                        f"pattern '{later}' has no wildcard (*, ?, [...]) so it matches "
                        "one user id only; list that user under 'users' instead",
                        where("match", j, "pattern"),
                    )
                )
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
                    f"user id {_shown(uid)} looks like {_shown(seen)} ({where('users', seen)}): "
                    "they are equal after Unicode NFKC normalization and case folding, "
                    "but are two users with two budgets",
                    where("users", uid),
                )
            )
    return out


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
    out += _anonymous_finding(policy, compiled, where)
    return out


# -- deployment rules ---------------------------------------------------------


def is_outrate_scheduler(name: str | None) -> bool:
    """None lets the outrate plugin pick its scheduler; anything else must be ours."""
    return name is None or "vllm_integration" in name or "outrate" in name


class DeploymentRule(NamedTuple):
    """One row of the deployment rules: a new rule is a new row."""

    code: str
    severity: Literal["error", "warning"]
    field: str
    applies: Callable[[Deployment], bool]
    message: Callable[[Deployment], str]


def _kv_connector_rejected(dep: Deployment) -> bool:
    return dep.kv_connector is not None and not (
        dep.kv_offload and dep.kv_connector in OFFLOAD_CONNECTORS
    )


DEPLOYMENT_RULES: tuple[DeploymentRule, ...] = (
    DeploymentRule(
        "OR101",
        "error",
        "speculative",
        lambda d: d.speculative,
        lambda d: (
            "speculative decoding is not supported: draft tokens are sampled without "
            "passing the per-user limiter"
        ),
    ),
    DeploymentRule(
        "OR102",
        "error",
        "data_parallel_size",
        lambda d: d.data_parallel_size > 1 and not d.store,
        lambda d: (
            f"data parallel size {d.data_parallel_size} needs a shared budget store: each "
            "data-parallel engine keeps its own budgets, so a user would get up to "
            f"{d.data_parallel_size} times its rate; pass --outrate-store redis://HOST:PORT/DB"
        ),
    ),
    DeploymentRule(
        "OR103",
        "error",
        "pipeline_parallel_size",
        lambda d: d.pipeline_parallel_size > 1,
        lambda d: (
            f"pipeline parallel size {d.pipeline_parallel_size} is not supported: "
            "several batches are in flight at once through vLLM's batch queue, which "
            "outrate's charge-at-dispatch and refund points do not cover"
        ),
    ),
    DeploymentRule(
        "OR104",
        "error",
        "kv_connector",
        _kv_connector_rejected,
        lambda d: (
            f"KV connector '{d.kv_connector}' is not supported: requests waiting for "
            "remote or loaded KV are scheduled through connector states outrate's "
            "scheduler does not charge, and disaggregated engines would each enforce "
            "their own budget"
        ),
    ),
    DeploymentRule(
        "OR105",
        "error",
        "ec_connector",
        lambda d: d.ec_connector is not None,
        lambda d: (
            f"EC connector '{d.ec_connector}' is not supported: it moves encoder "
            "(multimodal) outputs between engines, and multimodal models are not "
            "supported"
        ),
    ),
    DeploymentRule(
        "OR106",
        "error",
        "kv_offload",
        lambda d: d.kv_offload,
        lambda d: (
            "KV offloading is not supported: vLLM implements it as a KV connector "
            "(OffloadingConnector), and throttled requests keep their KV on the GPU "
            "by design, which offloading would undo behind the limiter's back"
        ),
    ),
    DeploymentRule(
        "OR107",
        "error",
        "aux_output",
        lambda d: d.aux_output,
        lambda d: (
            "auxiliary outputs (routed experts) are not supported: they travel through "
            "a scheduler-side aux-output connector that outrate's scheduler does not "
            "drive for throttled, skipped requests"
        ),
    ),
    DeploymentRule(
        "OR108",
        "error",
        "scheduler_cls",
        lambda d: not is_outrate_scheduler(d.scheduler_cls),
        lambda d: (
            f"scheduler class '{d.scheduler_cls}' is not outrate's: limits are "
            "enforced inside outrate's scheduler, so with another one nothing would "
            "be limited; remove --scheduler-cls and let the outrate plugin choose"
        ),
    ),
    DeploymentRule(
        "OR109",
        "error",
        "model_kind",
        lambda d: d.model_kind in REJECTED_MODEL_KINDS,
        lambda d: (
            f"{d.model_kind} models are not supported: {REJECTED_MODEL_KINDS[d.model_kind or '']}"
        ),
    ),
    DeploymentRule(
        "OR112",
        "warning",
        "chunked_prefill",
        lambda d: d.chunked_prefill is False,
        lambda d: (
            "chunked prefill is disabled: a throttled user's prompt cannot prefill "
            "ahead while it waits for budget, so its whole prefill runs after the "
            "wait and adds to its time to first token"
        ),
    ),
    DeploymentRule(
        "OR113",
        "warning",
        "store_fallback",
        lambda d: bool(d.store) and d.store_fallback == "full",
        lambda d: (
            "--outrate-store-fallback full: while the budget store is unreachable every "
            "engine enforces each user's full rate, so with N engines a user may get up "
            "to N times its rate; the default 'share' enforces rate/N on each"
        ),
    ),
)


def lint_deployment(dep: Deployment) -> list[Finding]:
    """Errors: configurations where the per-user limit cannot hold. Warnings:
    configurations where it holds but serves users worse than it could. The
    rules are rows of DEPLOYMENT_RULES, plus the OR111 slot check."""
    out = [
        Finding(rule.code, rule.severity, rule.message(dep), dep.where(rule.field))
        for rule in DEPLOYMENT_RULES
        if rule.code < "OR110" and rule.applies(dep)
    ]
    out += _active_seqs(dep)
    out += [
        Finding(rule.code, rule.severity, rule.message(dep), dep.where(rule.field))
        for rule in DEPLOYMENT_RULES
        if rule.code > "OR111" and rule.applies(dep)
    ]
    return out


def _active_seqs(dep: Deployment) -> list[Finding]:
    why = (
        "throttled requests keep their running slot, so only a cap below "
        "--max-num-seqs leaves them room to yield their turn to unthrottled requests"
    )
    seqs = "the vLLM default" if dep.max_num_seqs is None else str(dep.max_num_seqs)
    hint = f" (e.g. {dep.max_num_seqs * 3 // 4})" if dep.max_num_seqs else ""
    if dep.max_num_active_seqs is None:
        message = (
            f"--max-num-active-seqs is not set: {why}; set it below --max-num-seqs ({seqs}){hint}"
        )
    elif dep.max_num_seqs is not None and dep.max_num_active_seqs >= dep.max_num_seqs:
        message = (
            f"--max-num-active-seqs {dep.max_num_active_seqs} is not below "
            f"--max-num-seqs {dep.max_num_seqs}: {why}{hint}"
        )
    else:
        return []
    return [Finding("OR111", "warning", message, dep.where("max_num_active_seqs"))]


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
    if deployment is not None:
        findings += lint_deployment(deployment)
    return LintReport(source, compiled, problems, tuple(findings))
