"""Histograms in integer nanoseconds, with one JSON shape in every snapshot:
`[counts per bucket (the last is +Inf), sum_ns]`. The scheduler's metrics
(outrate.observe.metrics) and the budget store's (outrate.budget.shared.metrics) share it.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any


class Histogram:
    """Counts per bucket (the last is +Inf) and the sum, in ns. `count` is the
    sum of the buckets, so a snapshot is always self-consistent."""

    __slots__ = ("bounds", "buckets", "sum_ns")

    def __init__(self, bounds: tuple[int, ...]) -> None:
        self.bounds = bounds
        # A list, not an array('q'): CPython specializes `buckets[i] += n` on
        # a list, not on an array, where each update is slower.
        self.buckets = [0] * (len(bounds) + 1)
        self.sum_ns = 0

    def observe(self, ns: int, n: int = 1) -> None:
        self.buckets[bisect_left(self.bounds, ns)] += n
        self.sum_ns += ns * n

    def unobserve(self, ns: int) -> None:
        """Take back one `observe(ns)` (a refunded token's interval)."""
        self.observe(ns, -1)

    def to_json(self) -> list[Any]:
        return [list(self.buckets), self.sum_ns]


def add_json(a: list[Any], b: list[Any]) -> list[Any]:
    """The sum of two histograms in snapshot form (engines merged)."""
    return [[x + y for x, y in zip(a[0], b[0], strict=True)], a[1] + b[1]]


def cumulative(counts: list[int], bounds_s: tuple[float, ...]) -> list[tuple[str, int]]:
    """Prometheus buckets: (`le`, count at or below it), ending with +Inf."""
    out = []
    total = 0
    for bound, n in zip((*(f"{b:g}" for b in bounds_s), "+Inf"), counts, strict=True):
        total += n
        out.append((bound, total))
    return out
