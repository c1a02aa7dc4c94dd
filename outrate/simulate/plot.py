"""Pictures of a simulated run (`--plot DIR`), PNG through matplotlib's Agg
backend (no display needed; matplotlib is imported only when plotting).

- tokens.png: cumulative output tokens per user over time;
- gaps.png: each user's inter-token gaps, as a distribution (log scale);
- engine.png: batch size and KV use over time (held requests beside).

With two runs (`--compare`), both are drawn on each figure: the same colour
per user, A solid and B dashed. Sizes are small on purpose (a README image).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from outrate.errors import OutrateError
from outrate.simulate.report import RunResult

DPI = 80
SIZE = (7.0, 3.6)
MAX_POINTS = 2000
"""Points per line: a 60 s run has tens of thousands of steps and tokens."""
_STYLES = ("-", "--", ":", "-.")
LOG_RATIO = 20
"""Cumulative tokens go on a log scale when one user has this many times another's."""


def _thin(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    if len(xs) <= MAX_POINTS:
        return list(xs), list(ys)
    step = len(xs) / MAX_POINTS
    idx = sorted({int(i * step) for i in range(MAX_POINTS)} | {len(xs) - 1})
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise OutrateError(
            "--plot needs matplotlib: pip install 'outrate[simulate]' (or matplotlib)"
        ) from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend_runs(ax: Any, runs: Sequence[RunResult]) -> None:
    if len(runs) > 1:
        for i, r in enumerate(runs):
            ax.plot(
                [], [], color="0.3", linestyle=_STYLES[i % 4], label=f"{chr(65 + i)}: {r.label}"
            )


def _colors(runs: Sequence[RunResult]) -> dict[str, Any]:
    plt = _pyplot()
    users: list[str] = []
    for r in runs:
        users += [u for u in r.users if u not in users]
    cmap = plt.get_cmap("tab10" if len(users) <= 10 else "tab20")
    return {u: cmap(i % cmap.N) for i, u in enumerate(users)}


def plot_tokens(runs: Sequence[RunResult], path: Path) -> Path:
    plt = _pyplot()
    colors = _colors(runs)
    fig, ax = plt.subplots(figsize=SIZE, dpi=DPI)
    totals = [u.tokens for r in runs for u in r.users.values() if u.tokens]
    log = bool(totals) and max(totals) > LOG_RATIO * min(totals)  # else small users vanish
    for i, r in enumerate(runs):
        for name, u in r.users.items():
            times = [t / 1e9 for t in u.token_times]
            xs, ys = _thin(times, list(range(1, len(times) + 1)))
            label = name if i == 0 else None
            ax.step(xs, ys, where="post", color=colors[name], linestyle=_STYLES[i % 4], label=label)
    _legend_runs(ax, runs)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("output tokens (log)" if log else "output tokens")
    if log:
        ax.set_yscale("log")
    ax.set_title("cumulative tokens per user")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_gaps(runs: Sequence[RunResult], path: Path) -> Path:
    plt = _pyplot()
    colors = _colors(runs)
    fig, ax = plt.subplots(figsize=SIZE, dpi=DPI)
    for i, r in enumerate(runs):
        for name, u in r.users.items():
            gaps = sorted(g / 1e6 for g in u.gaps if g > 0)
            if not gaps:
                continue
            share = [(k + 1) / len(gaps) for k in range(len(gaps))]
            xs, ys = _thin(gaps, share)
            label = name if i == 0 else None
            ax.step(xs, ys, where="post", color=colors[name], linestyle=_STYLES[i % 4], label=label)
    _legend_runs(ax, runs)
    ax.set_xscale("log")
    ax.set_xlabel("gap between a request's tokens (ms, engine-side)")
    ax.set_ylabel("share of gaps <= x")
    ax.set_title("inter-token gaps per user")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_engine(runs: Sequence[RunResult], path: Path) -> Path:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(SIZE[0], SIZE[1] * 1.3), dpi=DPI, sharex=True)
    for i, r in enumerate(runs):
        tl = r.engine.timeline
        t = [x / 1e9 for x in tl.t]
        style = _STYLES[i % 4]
        tag = f"{chr(65 + i)} " if len(runs) > 1 else ""
        top.plot(*_thin(t, tl.batch), color="tab:blue", linestyle=style, label=f"{tag}batch")
        if any(tl.held):
            top.plot(*_thin(t, tl.held), color="tab:red", linestyle=style, label=f"{tag}held")
        kv = [k * 100 for k in tl.kv]
        bottom.plot(*_thin(t, kv), color="tab:green", linestyle=style, label=f"{tag}KV use")
    top.set_ylabel("requests")
    top.set_title("batch size and KV use")
    top.legend(fontsize=7, loc="upper right")
    top.grid(alpha=0.3)
    bottom.set_ylabel("KV cache (%)")
    bottom.set_xlabel("simulated time (s)")
    bottom.legend(fontsize=7, loc="upper right")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_runs(runs: Sequence[RunResult], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Every figure for `runs` (one, or two to compare) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_tokens(runs, out / "tokens.png"),
        plot_gaps(runs, out / "gaps.png"),
        plot_engine(runs, out / "engine.png"),
    ]
