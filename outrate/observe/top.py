"""`outrate top`: what each limit is doing right now, read from an engine's /metrics.

This module is the screen: the header line, the table, and the loops that
redraw it (`watch`) or print it once (`once`). What is on the page and what
changed between two scrapes is `outrate.observe.scrape`; its names are
importable from here too, where `outrate top`'s callers look for them. Only
`watch` and `once` wait, on a clock and a sleep tests replace.

No vLLM import here: `outrate top` runs on an operator's laptop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import monotonic, sleep

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from outrate.observe.scrape import (
    Clock,
    LimitValues,
    Row,
    Snapshot,
    TopError,
    metrics_url,
    parse,
    rows,
    scrape,
)

__all__ = [
    "LimitValues",
    "Row",
    "Snapshot",
    "TopError",
    "header",
    "make_console",
    "metrics_url",
    "once",
    "parse",
    "render",
    "rows",
    "scrape",
    "watch",
]

Sleep = Callable[[float], None]


def header(snapshot: Snapshot) -> str:
    """The policy being served and the engine-wide counters, in one line."""
    if snapshot.policy_sha256 is None:
        policy = "policy -"
    else:
        policy = f"policy {snapshot.policy_sha256[:12]} ({snapshot.policy_source or '-'})"
    reloads = snapshot.reloads
    if reloads is None:
        reload_text = "-"
    else:
        applied, rejected = reloads.get("applied"), reloads.get("rejected")
        reload_text = f"{_whole(applied)} applied, {_whole(rejected)} rejected"
    deferred = snapshot.deferred
    deferred_text = (
        "-"
        if deferred is None
        else ", ".join(f"{reason} {_whole(n)}" for reason, n in sorted(deferred.items()))
    )
    return (
        f"{policy}; reloads: {reload_text}; displaced: {_whole(snapshot.displaced)}; "
        f"deferred: {deferred_text}"
    )


COLUMNS = (
    "limit",
    "rate tok/s",
    "borrowed tok/s",
    "limit tok/s",
    "peak tok/s",
    "mode",
    "held",
    "live",
    "throttled",
    "shadow over tok/s",
    "prompt tok/s",
    "prompt limit tok/s",
    "prompt waiting",
    "429 requests/s",
    "429 quota/s",
)


def render(
    url: str,
    prev: Snapshot | None,
    cur: Snapshot,
    *,
    limit_filter: str | None = None,
    max_rows: int | None = None,
    error: str | None = None,
) -> RenderableType:
    """Two header lines and the table. `max_rows` crops it to a terminal and says so."""
    over = f"rates over {cur.at - prev.at:.2f}s" if prev is not None else "first scrape"
    lines = [Text(f"outrate top {url} ({over})"), Text(_shown(header(cur)))]
    if error is not None:
        lines.append(Text(f"{error}; retrying, figures below are from the last scrape", "red"))
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("limit", "mode") else "right")
    all_rows = rows(prev, cur, limit_filter)
    shown = all_rows if max_rows is None else all_rows[:max_rows]
    for row in shown:
        table.add_row(*_cells(row), style=_style(row))
    parts: list[RenderableType] = [*lines, table]
    if len(shown) < len(all_rows):
        parts.append(Text(f"... {len(all_rows) - len(shown)} more (--limit-filter GLOB)"))
    return Group(*parts)


def _cells(row: Row) -> tuple[Text, ...]:
    """Text, never markup: a user id like `[/]` or `[bold]x` is shown as it is."""
    cells = (
        row.limit,
        _fixed(row.rate),
        _fixed(row.borrowed),
        _configured(row.rate_limit),
        _configured(row.peak),
        row.mode or "-",
        _whole(row.held),
        _whole(row.live),
        _share(row.throttled),
        _fixed(row.shadow_over),
        _fixed(row.prompt),
        _configured(row.prompt_limit),
        _whole(row.prompt_waiting),
        _fixed(row.refused),
        _fixed(row.quota_refused),
    )
    return tuple(Text(_shown(cell)) for cell in cells)


def _shown(text: str) -> str:
    """`text` with each unprintable character escaped (`\\x1b`, `\\u202e`): labels
    come from the page, and an escape sequence in one would reach the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _style(row: Row) -> str:
    if row.throttled is not None and row.throttled >= 0.5:
        return "red"
    return "yellow" if row.held else ""


# Non-finite values print as Python prints them (inf, -inf, nan): a page may say anything.


def _fixed(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _configured(value: float | None) -> str:
    if value is None:
        return "-"
    if value == math.inf:
        return "unlimited"
    if not math.isfinite(value) or value == int(value):
        return f"{value:.0f}"
    return f"{value:.3f}".rstrip("0")


def _whole(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _share(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if math.isfinite(value) else f"{value:.0f}"


UNWRAPPED = 10_000
"""Columns for a pipe: wide enough that no row of the table is folded."""


def make_console() -> Console:
    """stdout; plain and never wrapped when it is not a terminal (a script reads it)."""
    console = Console(highlight=False)
    if console.is_terminal:
        return console
    return Console(highlight=False, width=UNWRAPPED)


def once(
    url: str,
    *,
    interval: float,
    timeout: float,
    console: Console,
    limit_filter: str | None = None,
    clock: Clock | None = None,
    sleep_for: Sleep | None = None,
) -> None:
    """Two scrapes `interval` apart, one table printed (for scripts)."""
    now = clock or monotonic
    first = scrape(url, timeout, now)
    (sleep_for or sleep)(interval)
    second = scrape(url, timeout, now)
    console.print(render(url, first, second, limit_filter=limit_filter))


FRAME_LINES = 6
"""Terminal lines a frame needs besides its rows: headers, error, "more", the cursor's."""


def watch(
    url: str,
    *,
    interval: float,
    timeout: float,
    console: Console,
    limit_filter: str | None = None,
    clock: Clock | None = None,
    sleep_for: Sleep | None = None,
) -> None:
    """Redraw every `interval` seconds until KeyboardInterrupt.

    A failing first scrape raises (nothing to show); later failures (the
    engine restarting, say) are shown over the last figures and retried.
    """
    now, wait = clock or monotonic, sleep_for or sleep
    cur = scrape(url, timeout, now)
    prev: Snapshot | None = None

    def frame(error: str | None = None) -> RenderableType:
        rows_left = max(console.size.height - FRAME_LINES, 1) if console.is_terminal else None
        return render(url, prev, cur, limit_filter=limit_filter, max_rows=rows_left, error=error)

    with _display(console, frame()) as show:
        due = now() + interval
        while True:
            wait(max(due - now(), 0.0))
            due = max(due, now()) + interval  # a slow scrape delays, never bunches, the next
            try:
                prev, cur = cur, scrape(url, timeout, now)
            except TopError as e:
                show(frame(str(e)))
                continue
            show(frame())


@contextmanager
def _display(console: Console, first: RenderableType) -> Iterator[Callable[[RenderableType], None]]:
    """Redraw in place on a terminal; on a pipe, print frame after frame (like `top -b`)."""
    if console.is_terminal:
        with Live(first, console=console, auto_refresh=False) as live:
            yield lambda frame: live.update(frame, refresh=True)
        return

    def append(frame: RenderableType) -> None:
        console.line()
        console.print(frame)

    console.print(first)
    yield append
