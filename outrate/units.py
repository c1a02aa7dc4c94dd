"""How rates, durations and counts are spelled in every message outrate
writes (log lines, lint findings, reload summaries, CLI output). One
formatter each, so the same value reads the same everywhere. A leaf: no
outrate import."""

from __future__ import annotations

from fractions import Fraction

_UNIT_NS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


def format_rate(rate: Fraction | None) -> str:
    """`20`, `0.5`, `0.333333` (a rate shown, not dumped: see
    policy._dump_rate for the exact form), or `unlimited` for None."""
    if rate is None:
        return "unlimited"
    return str(rate.numerator) if rate.denominator == 1 else f"{float(rate):g}"


def format_duration(ns: int) -> str:
    """The shortest exact spelling (`100ms`, `250us`, `2s`), so a dumped
    policy reads like a written one."""
    for unit in ("s", "ms", "us"):
        if ns % _UNIT_NS[unit] == 0:
            return f"{ns // _UNIT_NS[unit]}{unit}"
    return f"{ns}ns"


def format_count(n: int, word: str) -> str:
    """`1 error`, `3 errors`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
