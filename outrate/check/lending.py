"""OR012: a committed rate that leaves lending no time (docs/time-aware-
borrowing.md, "The rule").

While some rule has a peak, each step lends only the time no committed user
needs: at most `n_u / r_u` for a user with `n_u` streams at rate `r_u`. A
rate so high that even every stream the engine can hold for it
(`--max-num-seqs`, or the rule's `max_streams`) needs steps shorter than any
engine step leaves nothing: the steps its user runs in lend nothing to
anyone. It is usually a large number written to mean "no limit", which
`unlimited` says without that cost.
"""

from __future__ import annotations

from outrate.budget.gcra import Limit, lends
from outrate.check.prompts import limits_by_path, rule_name
from outrate.check.rules import Finding
from outrate.policy.compiler import CompiledPolicy

SHORTEST_STEP_S = 0.002
"""No engine step is shorter: the tiny CPU model's decode step of one request
takes ~2.5 ms (docs/simulate.md), a GPU's for a real model longer."""
DEFAULT_MAX_NUM_SEQS = 1024
"""Where `--max-num-seqs` is not given, vLLM's largest default (by usage
context and device): the most streams a user can have."""


def _streams(lim: Limit, max_num_seqs: int) -> int:
    cap = lim.max_streams
    return cap if cap is not None and cap < max_num_seqs else max_num_seqs


def _blocks(lim: Limit, max_num_seqs: int) -> bool:
    return (
        lim.rate is not None
        and not lim.shadow
        and _streams(lim, max_num_seqs) * lim.token_s < SHORTEST_STEP_S
    )


def unlendable_rates(policy: CompiledPolicy, max_num_seqs: int | None) -> list[Finding]:
    """OR012 for each written rule whose committed rate needs steps shorter
    than SHORTEST_STEP_S with all its streams, while the policy lends.
    `max_num_seqs`: the engine's, None where not known."""
    limits = policy.all_limits()
    if not lends(limits) and not lends(lim.prompt for lim in limits):
        return []
    seqs = max_num_seqs or DEFAULT_MAX_NUM_SEQS
    validated = policy.policy
    if validated is None:  # a hand-built CompiledPolicy: what its limits resolved to
        seen = {lim.rule: lim for lim in policy.all_limits() if _blocks(lim, seqs)}
        return [_finding(name, lim, seqs, policy.source) for name, lim in seen.items()]
    by_path = limits_by_path(policy)
    out = []
    for path, rule in validated.rules():
        lim = by_path.get(path)
        if lim is None or getattr(rule, "tier", None) is not None or not _blocks(lim, seqs):
            continue  # a tier's users: the tier is named itself
        line, col = validated.position(*path, "rate") or validated.position(*path) or (1, 1)
        out.append(_finding(rule_name(path), lim, seqs, f"{policy.source}:{line}:{col}"))
    return out


def _finding(name: str, lim: Limit, seqs: int, where: str) -> Finding:
    n = _streams(lim, seqs)
    why = "its max_streams" if n < seqs else f"--max-num-seqs {seqs}"
    if n == seqs and n == DEFAULT_MAX_NUM_SEQS:
        why = f"vLLM's largest default --max-num-seqs, {seqs}"
    return Finding(
        "OR012",
        "warning",
        f"{name}: rate {lim.rate} tok/s leaves lending no time: even {n} streams "
        f"({why}) need a step every {n * lim.token_s * 1000:.2f} ms to get it, shorter "
        f"than any engine step, so the steps this user runs in lend nothing to users "
        f"with a peak; write rate: unlimited if no limit is meant",
        where,
    )
