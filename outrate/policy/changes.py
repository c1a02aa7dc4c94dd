"""What a policy reload changed, in one line for the reload log
(`alice 20 -> 60 tok/s, 2 users added`). Compares effective limits, not
spelling."""

from __future__ import annotations

from collections.abc import Mapping

from outrate.budget.gcra import per_window_text
from outrate.budget.limiter import Limit
from outrate.identity.core import IdentityConfig
from outrate.policy.compiler import CompiledPolicy, peak_text
from outrate.units import format_duration, format_rate

_MAX_ITEMS = 5
"""Per kind of change in the log line; the rest is `... and N more`."""


def describe_changes(old: CompiledPolicy | None, new: CompiledPolicy) -> str:
    """One line saying what an operator's edit changed, for the reload log.

    Compares effective limits (rate, burst, peak, stream cap, prompt,
    requests, shadow) and the header style, not spelling: moving a user into
    a tier with the same numbers is "no effective change", and a new
    policy-wide burst is reported once, not once per user that inherits it.
    """
    if old is None:
        return f"loaded {brief(new)}"
    parts: list[str] = []
    if not _same(old.default, new.default, old, new):
        parts.append(f"default {_change(old.default, new.default, old, new)}")
    # An anonymous budget that tracks the default was just reported as the default.
    tracks = old.anonymous == old.default and new.anonymous == new.default
    if not tracks and not _same(old.anonymous, new.anonymous, old, new):
        parts.append(f"anonymous {_change(old.anonymous, new.anonymous, old, new)}")
    if old.burst_ns != new.burst_ns:
        parts.append(f"burst {format_duration(old.burst_ns)} -> {format_duration(new.burst_ns)}")
    parts += _diff("tier ", old.tiers, new.tiers, old, new)
    if [p for p, _ in old.patterns] != [p for p, _ in new.patterns] or not all(
        _same(a, b, old, new) for (_, a), (_, b) in zip(old.patterns, new.patterns, strict=True)
    ):
        a, b = dict(old.patterns), dict(new.patterns)
        # Same rules in another order still matters: the first match decides.
        parts += _diff("pattern ", a, b, old, new) or ["patterns reordered"]
    parts += _diff("", old.users, new.users, old, new, fallback=True)
    parts += _identity_changes(old.identity, new.identity)
    if old.headers != new.headers:
        parts.append(f"headers {old.headers} -> {new.headers}")
    return "; ".join(parts) if parts else "no effective change"


def _identity_changes(old: IdentityConfig, new: IdentityConfig) -> list[str]:
    """Source, header and claim handling; keys by digest prefix and user
    (digests are safe to log: keys never are, and never reach this code)."""
    parts: list[str] = []
    if (old.source, old.header, old.on_claim_mismatch) != (
        new.source,
        new.header,
        new.on_claim_mismatch,
    ):
        parts.append(f"identity {old.describe()} -> {new.describe()}")
    a = old.keys.digests() if old.keys is not None else {}
    b = new.keys.digests() if new.keys is not None else {}
    if new.source == "api_key" and a != b:
        added = [f"key {d[:19]}... ({u}) added" for d, u in b.items() if a.get(d) != u]
        gone = [f"key {d[:19]}... ({u}) revoked" for d, u in a.items() if b.get(d) != u]
        parts += _cap(added) + _cap(gone)
    return parts


def _diff(
    prefix: str,
    a: Mapping[str, Limit],
    b: Mapping[str, Limit],
    old: CompiledPolicy,
    new: CompiledPolicy,
    *,
    fallback: bool = False,
) -> list[str]:
    added = [f"{prefix}{k} added ({_short(b[k], new)})" for k in b if k not in a]
    removed = []
    for k in (k for k in a if k not in b):
        if fallback:  # a removed user is not unlimited: say what applies now
            now = new.limit_for(k)
            rule = f"{now.rule} " if now.rule else ""
            removed.append(f"{prefix}{k} removed (now {rule}{_short(now, new)})")
        else:
            removed.append(f"{prefix}{k} removed")
    changed = [
        f"{prefix}{k} {_change(a[k], b[k], old, new)}"
        for k in b
        if k in a and not _same(a[k], b[k], old, new)
    ]
    return _cap(added) + _cap(removed) + _cap(changed)


def _same(a: Limit, b: Limit, old: CompiledPolicy, new: CompiledPolicy) -> bool:
    """Equal, or differing only by inheriting the policy burst (reported once)."""
    if a == b:
        return True
    return (
        (a.rate, a.max_streams, a.peak, a.shadow) == (b.rate, b.max_streams, b.peak, b.shadow)
        and a.burst_ns == old.burst_ns
        and b.burst_ns == new.burst_ns
        and _prompt(a, old) == _prompt(b, new)
        and a.requests == b.requests
    )


def _prompt(limit: Limit, policy: CompiledPolicy) -> str:
    """The rule's prompt limit as the change line shows it ("": unlimited);
    its burst only where it is not the policy's."""
    prompt = limit.prompt
    if prompt is None or prompt.rate is None:
        return ""
    text = f" prompt {format_rate(prompt.rate)} tok/s"
    if prompt.burst_ns != policy.burst_ns:
        text += f" burst {format_duration(prompt.burst_ns)}"
    if prompt.peak is not None:
        text += f" peak {peak_text(prompt.peak)}"
    return text


def _cap(items: list[str]) -> list[str]:
    if len(items) <= _MAX_ITEMS:
        return items
    return items[:_MAX_ITEMS] + [f"... and {len(items) - _MAX_ITEMS} more"]


def _tail(limit: Limit, policy: CompiledPolicy) -> str:
    """Burst (only where it is not the policy's), peak, stream cap, prompt
    limit, and `shadow` for a limit counted but not enforced."""
    text = ""
    if limit.rate is not None and limit.burst_ns != policy.burst_ns:
        text += f" burst {format_duration(limit.burst_ns)}"
    if limit.peak is not None:
        text += f" peak {peak_text(limit.peak)}"
    if limit.max_streams is not None:
        text += f" max_streams {limit.max_streams}"
    text += _prompt(limit, policy)
    if limit.requests is not None:
        text += f" requests {per_window_text(limit.requests)}"
    if limit.shadow and (limit.rate is not None or limit.max_streams is not None):
        text += " shadow"
    return text


def _short(limit: Limit, policy: CompiledPolicy) -> str:
    rate = "unlimited" if limit.rate is None else f"{format_rate(limit.rate)} tok/s"
    return rate + _tail(limit, policy)


def _change(a: Limit, b: Limit, old: CompiledPolicy, new: CompiledPolicy) -> str:
    """`20 -> 60 tok/s` when only the rate moved, else both sides in full."""
    tail = _tail(b, new)
    if a.rate is not None and b.rate is not None and _tail(a, old) == tail:
        return f"{format_rate(a.rate)} -> {format_rate(b.rate)} tok/s{tail}"
    return f"{_short(a, old)} -> {_short(b, new)}"


def brief(policy: CompiledPolicy | None) -> str:
    if policy is None:
        return "no policy loaded yet"
    counts = [
        f"{n} {word}{'' if n == 1 else 's'}"
        for n, word in ((len(policy.users), "user"), (len(policy.tiers), "tier"),
                        (len(policy.patterns), "pattern"))
        if n or word == "user"
    ]  # fmt: skip
    return f"{', '.join(counts)}, default {_short(policy.default, policy)}"
