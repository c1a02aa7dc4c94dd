"""The answer of a simulated run: per-user and engine figures, as a table,
side by side with another run, or as JSON for scripts.

Times are in nanoseconds inside, shown as ms or s. A user's rate is the
trace's: (tokens - 1) / (last token - first token), over all its streams
(`outrate.observe.trace.engine_rate`), so a simulated rate compares with
one read from a real engine's `--outrate-trace`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[int], q: float) -> int | None:
    """Linear interpolation between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


@dataclass
class Timeline:
    """Per step: when (ns from the start), batch size, KV use, held, queued."""

    t: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    kv: list[float] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)

    def add(self, t: int, batch: int, kv: float, held: int, queued: int) -> None:
        self.t.append(t)
        self.batch.append(batch)
        self.kv.append(kv)
        self.held.append(held)
        self.queued.append(queued)


@dataclass
class UserStats:
    user: str
    tokens: int
    rate: float
    """Output tokens per second, first token to last."""
    ttft_p50: int | None
    ttft_p99: int | None
    gap_p50: int | None
    gap_p99: int | None
    held_share: float
    """Time its live requests spent held (throttled, keeping their KV), as a share."""
    deferred: int
    """Admissions deferred (budget or max_streams), once per deferral."""
    arrived: int
    completed: int
    started: int = 0
    """Requests that got a first token (cut at the end included): the
    population of the time to first token."""
    prompt_tokens: int = 0
    """Prompt positions the engine computed for it (prefix-cache hits are
    not computed; recomputation after a preemption is)."""
    prompt_rate: float = 0.0
    """`prompt_tokens` per second of the run."""
    prompt_steps: list[tuple[int, int]] = field(repr=False, default_factory=list)
    """(ns from the start, prompt tokens) per step that computed any, stamped
    when the step was dispatched."""
    token_times: list[int] = field(repr=False, default_factory=list)
    gaps: list[int] = field(repr=False, default_factory=list)
    ttfts: list[int] = field(repr=False, default_factory=list)
    """Each started request's time to first token (ns), in order of first token."""

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "tokens_per_s": round(self.rate, 3),
            "ttft_p50_ms": _ms(self.ttft_p50),
            "ttft_p99_ms": _ms(self.ttft_p99),
            "gap_p50_ms": _ms(self.gap_p50),
            "gap_p99_ms": _ms(self.gap_p99),
            "held_share": round(self.held_share, 4),
            "deferred": self.deferred,
            "requests": self.arrived,
            "completed": self.completed,
            "started": self.started,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_per_s": round(self.prompt_rate, 3),
        }


@dataclass
class EngineStats:
    steps: int
    seconds: float
    tokens: int
    throughput: float
    busy_share: float
    preemptions: int
    """Every preemption, fair-admission displacements included."""
    displaced: int
    timeline: Timeline = field(repr=False, default_factory=Timeline)

    @property
    def kv_preemptions(self) -> int:
        return self.preemptions - self.displaced

    def to_json(self) -> dict[str, Any]:
        tl = self.timeline
        return {
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "tokens": self.tokens,
            "tokens_per_s": round(self.throughput, 2),
            "busy_share": round(self.busy_share, 4),
            "batch_mean": round(_mean(tl.batch), 2),
            "batch_max": max(tl.batch, default=0),
            "kv_mean": round(_mean(tl.kv), 4),
            "kv_max": round(max(tl.kv, default=0.0), 4),
            "held_max": max(tl.held, default=0),
            "preemptions": self.kv_preemptions,
            "displaced": self.displaced,
        }


@dataclass
class RunResult:
    label: str
    users: dict[str, UserStats]
    engine: EngineStats
    wall_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    partial: str = ""
    """Why the run stopped before the workload's end (Ctrl-C); "" if it did not."""
    prompt_limited: bool = False
    """Its policy limits some user's prompts: the tables show prompt tok/s."""

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            **({"partial": self.partial} if self.partial else {}),
            **self.meta,
            "wall_s": round(self.wall_s, 3),
            "prompt_limited": self.prompt_limited,
            "users": {name: u.to_json() for name, u in self.users.items()},
            "engine": self.engine.to_json(),
        }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _ms(ns: int | None) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)


def format_time(ns: int | None) -> str:
    if ns is None:
        return "-"
    if ns < 1_000_000:
        return f"{ns / 1e6:.2f}ms"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.0f}ms"
    return f"{ns / 1e9:.2f}s"


_HEAD = ("user", "tok/s", "TTFT p50", "TTFT p99", "gap p50", "gap p99", "held", "deferred", "done")
PROMPT_HEAD = "prompt/s"
"""The column of prompt tokens computed per second, shown where a run's
policy limits prompts (tables without prompt limits read as before)."""


def _row(u: UserStats, prompts: bool = False) -> list[str]:
    row = [
        u.user,
        f"{u.rate:.1f}",
        format_time(u.ttft_p50),
        format_time(u.ttft_p99),
        format_time(u.gap_p50),
        format_time(u.gap_p99),
        f"{u.held_share:.0%}",
        str(u.deferred),
        f"{u.completed}/{u.arrived}",
    ]
    if prompts:
        row.insert(2, f"{u.prompt_rate:.0f}")
    return row


def _table(head: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [list(head), *rows]) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return [line(head), *map(line, rows)]


def engine_line(e: EngineStats) -> str:
    j = e.to_json()
    return (
        f"engine: {e.steps} steps in {e.seconds:g}s, {e.throughput:.0f} tok/s, busy "
        f"{e.busy_share:.0%}; batch mean {j['batch_mean']:g} (max {j['batch_max']}), "
        f"KV mean {j['kv_mean']:.0%} (max {j['kv_max']:.0%}), held max {j['held_max']}, "
        f"preemptions {e.kv_preemptions}, displaced {e.displaced}"
    )


def format_run(result: RunResult) -> str:
    """The table per user, then the engine's line."""
    lines = [f"== {result.label}"] if result.label else []
    if result.partial:
        lines.append(f"== PARTIAL: {result.partial}")
    prompts = result.prompt_limited
    head = (*_HEAD[:2], PROMPT_HEAD, *_HEAD[2:]) if prompts else _HEAD
    lines += _table(head, [_row(u, prompts) for u in result.users.values()])
    lines.append(engine_line(result.engine))
    return "\n".join(lines)


def _change(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return ""
    if a == 0:
        return "" if b == 0 else "(new)"
    pct = (b - a) / a * 100
    return f"({pct:+.0f}%)"


def format_compare(a: RunResult, b: RunResult) -> str:
    """Both runs per user, `A -> B (change)`, then both engine lines."""
    prompts = a.prompt_limited or b.prompt_limited
    head: tuple[str, ...] = ("user", "tok/s", "TTFT p50", "TTFT p99", "gap p99", "held", "done")
    if prompts:
        head = (*head[:2], PROMPT_HEAD, *head[2:])
    rows = []
    for name in a.users.keys() | b.users.keys():
        ua, ub = a.users.get(name), b.users.get(name)
        if ua is None or ub is None:
            continue
        rows.append(
            [
                name,
                f"{ua.rate:.1f} -> {ub.rate:.1f} {_change(ua.rate, ub.rate)}".rstrip(),
                f"{format_time(ua.ttft_p50)} -> {format_time(ub.ttft_p50)}",
                f"{format_time(ua.ttft_p99)} -> {format_time(ub.ttft_p99)}",
                f"{format_time(ua.gap_p99)} -> {format_time(ub.gap_p99)}",
                f"{ua.held_share:.0%} -> {ub.held_share:.0%}",
                f"{ua.completed} -> {ub.completed}",
            ]
        )
        if prompts:
            rows[-1].insert(2, f"{ua.prompt_rate:.0f} -> {ub.prompt_rate:.0f}")
    order = list(a.users)
    rows.sort(key=lambda r: order.index(r[0]) if r[0] in order else len(order))
    lines = [f"== A: {a.label}", f"== B: {b.label}"]
    lines += [f"== PARTIAL: {r.partial}" for r in (a, b) if r.partial]
    lines += _table(head, rows)
    lines += ["A " + engine_line(a.engine), "B " + engine_line(b.engine)]
    return "\n".join(lines)
