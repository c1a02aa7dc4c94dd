"""Prompt limits against the policy and the deployment (docs/prompt-limits.md):
the lint warning OR011 and the two configurations the engine refuses, OR118
and OR119 (a shared store with chunked prefill off). The refusals are
defined here once, as located `Problem`s: `outrate lint` reports them, and
the engine core raises them at start and on reload
(vllm_integration/common/config.py), with the same text.
"""

from __future__ import annotations

from collections.abc import Callable

from outrate.budget.gcra import Limit
from outrate.errors import Problem
from outrate.policy.compiler import CompiledPolicy

SHARED_PROMPTS = (
    "with --outrate-store and chunked prefill off, a prompt limit cannot be kept: a "
    "prompt is then computed whole, but an engine holds a shared budget's credit one "
    "lease slice at a time (rate x lease horizon, docs/several-engines.md), so a prompt "
    "longer than the slice would wait forever; enable chunked prefill, or remove "
    "'prompt' from: "
)
"""OR119: `--outrate-store` with a prompt limit and chunked prefill off."""


def burst_tokens(lim: Limit) -> int | None:
    """The most tokens a full bucket of `lim` gives at once (`rate * burst +
    1`, exactly as `gcra()` counts), None when unlimited."""
    if lim.unlimited:
        return None
    return lim.tolerance // lim.interval + 1


def _located(
    policy: CompiledPolicy, rules: list[str], pick: Callable[[Limit], bool], message: str
) -> Problem:
    """`message` at the first written `prompt` whose compiled limit `pick`
    chooses (the policy's start when the policy was built by hand)."""
    validated = policy.policy
    if validated is not None:
        by_path = limits_by_path(policy)
        for path, rule in validated.rules():
            lim = by_path.get(path)
            if rule.prompt is not None and lim is not None and pick(lim):
                line, col = validated.position(*path, "prompt") or (1, 1)
                field = ".".join(map(str, path)) + ".prompt"
                return Problem(policy.source, line, col, field, message)
    return Problem(policy.source, 1, 1, f"{rules[0]}.prompt", message)


def rule_name(path: tuple[str | int, ...]) -> str:
    """A written rule's name in a finding: `users.alice`, `match[2]`."""
    return f"match[{path[1]}]" if path[0] == "match" else ".".join(map(str, path))


def limits_by_path(policy: CompiledPolicy) -> dict[tuple[str | int, ...], Limit]:
    """Each written rule's path -> its compiled limit."""
    out: dict[tuple[str | int, ...], Limit] = {
        ("default",): policy.default,
        ("anonymous",): policy.anonymous,
    }
    out.update({("tiers", name): lim for name, lim in policy.tiers.items()})
    out.update({("users", uid): lim for uid, lim in policy.users.items()})
    out.update({("match", i): lim for i, (_, lim) in enumerate(policy.patterns)})
    return out


def shared_prompts_problem(policy: CompiledPolicy) -> Problem | None:
    """OR119: a prompt budget shared through `--outrate-store` is leased a
    slice at a time, so without chunked prefill (the whole prompt in one
    step) a long prompt would never fit. None: no prompt limit."""
    rules = policy.prompt_rules
    if not rules:
        return None
    return _located(
        policy, rules, lambda lim: _limited(lim.prompt), SHARED_PROMPTS + ", ".join(rules)
    )


def _limited(prompt: Limit | None) -> bool:
    return prompt is not None and not prompt.unlimited


def _too_short(prompt: Limit | None, max_model_len: int) -> bool:
    """An enforced prompt limit whose full bucket holds less than the longest prompt."""
    if prompt is None or prompt.shadow:
        return False
    tokens = burst_tokens(prompt)
    return tokens is not None and tokens < max_model_len


def unchunked_prompts_problem(policy: CompiledPolicy, max_model_len: int) -> Problem | None:
    """OR118: without chunked prefill a prompt is computed whole, and admitted
    only when its user's prompt bucket holds all of it; a prompt longer than
    the bucket would wait forever, so the configuration is refused. None:
    every enforced prompt limit holds `max_model_len` tokens."""
    short = [
        lim.prompt
        for lim in policy.all_limits()
        if lim.prompt is not None and _too_short(lim.prompt, max_model_len)
    ]
    if not short:
        return None
    rules = list(dict.fromkeys(p.rule.removesuffix(".prompt") for p in short))
    smallest = min(burst_tokens(p) or 0 for p in short)
    message = (
        f"without chunked prefill a prompt is computed whole, so a prompt limit must hold "
        f"the longest prompt (max_model_len {max_model_len} tokens), but its burst holds "
        f"{smallest} (rate x burst + 1): such prompts would wait forever; enable chunked "
        "prefill, or raise the prompt's rate or burst, in: " + ", ".join(rules)
    )
    return _located(policy, rules, lambda lim: _too_short(lim.prompt, max_model_len), message)


def open_prompts_rules(policy: CompiledPolicy) -> list[tuple[tuple[str | int, ...], str]]:
    """OR011's rules: (path, name) of each written rule that caps output and
    leaves prompts unlimited without saying so (no `prompt`; `prompt:
    unlimited` written is a choice, not a hole). A rule that names a tier
    and writes no `prompt` has its tier's, so the tier is the one named.
    Shadow rules cap nothing."""
    validated = policy.policy
    out: list[tuple[tuple[str | int, ...], str]] = []
    if validated is None:  # a hand-built CompiledPolicy: what its limits resolved to
        seen: set[str] = set()
        for lim in policy.all_limits():
            if not lim.unlimited and not lim.shadow and lim.prompt is None and lim.rule not in seen:
                seen.add(lim.rule)
                out.append(((), lim.rule))
        return out
    by_path = limits_by_path(policy)
    for path, rule in validated.rules():
        got = by_path.get(path)
        if got is None or got.unlimited or got.shadow or rule.prompt is not None:
            continue
        if getattr(rule, "tier", None) is not None:
            continue  # its tier's prompt, or the tier is named itself
        out.append((path, rule_name(path)))
    return out


def open_prompts_message(names: list[str]) -> str:
    return (
        f"{', '.join(names)}: output capped, prompts unlimited: a user inside its output "
        "rate can fill every step with prefill; add prompt: RATE (size it with "
        "outrate simulate), or write prompt: unlimited where that is meant"
    )


def prompt_refusals(
    policy: CompiledPolicy, store: bool, chunked: bool | None, max_model_len: int | None
) -> list[tuple[str, Problem]]:
    """(code, problem) of each prompt configuration the engine refuses:
    OR118 (chunked prefill off, `chunked is False`; checked only where
    `max_model_len` is known) and OR119 (`store`: `--outrate-store`, with
    chunked prefill off). With chunked prefill, prompt budgets are shared
    through the store as output budgets are."""
    out: list[tuple[str, Problem]] = []
    if chunked is False and max_model_len is not None:
        problem = unchunked_prompts_problem(policy, max_model_len)
        if problem is not None:
            out.append(("OR118", problem))
    if store and chunked is False:
        problem = shared_prompts_problem(policy)
        if problem is not None:
            out.append(("OR119", problem))
    return out
