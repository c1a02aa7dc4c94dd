"""Quota windows and usage (outrate/budget/quota.py): UTC calendar windows,
usage that never carries into the next window, and the spent decision."""

from __future__ import annotations

import calendar

import pytest

from outrate.budget.quota import Quota, QuotaBook, spent, window_bounds


def utc(*parts: int) -> int:
    return calendar.timegm((*parts, 0, 0, 0)[:6])


D4, D5 = utc(2026, 12, 4), utc(2026, 12, 5)


@pytest.mark.parametrize(
    ("window", "now", "start", "end"),
    [
        ("hour", D4 + 10 * 3600 + 3599, D4 + 10 * 3600, D4 + 11 * 3600),
        ("day", D5 - 1, D4, D5),
        ("week", D4 + 12 * 3600, utc(2026, 11, 30), utc(2026, 12, 7)),
        ("week", utc(2026, 11, 30), utc(2026, 11, 30), utc(2026, 12, 7)),
        ("month", utc(2026, 12, 31, 23), utc(2026, 12, 1), utc(2027, 1, 1)),
        ("month", utc(2028, 2, 29, 5), utc(2028, 2, 1), utc(2028, 3, 1)),
    ],
)  # fmt: skip
def test_windows_follow_the_utc_calendar(window: str, now: int, start: int, end: int) -> None:
    assert window_bounds(window, now) == (start, end)
    assert window_bounds(window, now + 0.5) == (start, end)


def test_usage_counts_in_the_current_window_and_never_carries_over() -> None:
    now = [float(utc(2026, 12, 4, 23, 59, 0))]
    book = QuotaBook(clock=lambda: now[0])
    book.add("alice", "output", 70, ["day", "hour"])
    book.add("alice", "output", 50, ["day", "hour"])
    assert book.used("alice", "output", "day") == 120
    assert book.used("alice", "prompt", "day") == 0
    now[0] += 120  # the next day (and hour)
    assert book.used("alice", "output", "day") == 0
    book.add("alice", "output", 5, ["day"])
    assert book.used("alice", "output", "day") == 5
    assert book.snapshot() == {"alice": {"output/day": [utc(2026, 12, 5, 0, 0, 0), 5]}}


def test_a_restart_loads_the_saved_usage_of_the_current_window_only() -> None:
    now = float(utc(2026, 12, 4, 12, 0, 0))
    first = QuotaBook(clock=lambda: now)
    first.add("alice", "output", 900, ["day", "hour"])
    saved = first.snapshot()
    saved["bob"] = {"output/day": [utc(2026, 12, 3, 0, 0, 0), 10**6]}  # yesterday
    second = QuotaBook(clock=lambda: now)
    second.add("alice", "output", 100, ["day"])  # counted before the file was read
    second.load(saved)
    assert second.used("alice", "output", "day") == 1000
    assert second.used("alice", "output", "hour") == 900
    assert second.used("bob", "output", "day") == 0
    assert second.reset("alice") and second.used("alice", "output", "day") == 0


def test_spent_names_the_quota_that_resets_last() -> None:
    now = float(utc(2026, 12, 4, 12, 30, 0))
    quotas = (Quota("output", 100, "hour"), Quota("prompt", 1000, "day"))
    book = QuotaBook(clock=lambda: now)
    book.add("u", "output", 99, ["hour"])
    assert spent(quotas, book.users["u"], now) is None
    book.add("u", "output", 5, ["hour"])  # an overrun: counted
    s = spent(quotas, book.users["u"], now)
    assert s is not None and s.quota == quotas[0] and s.used == 104 and s.reset_s == 1800
    book.add("u", "prompt", 1000, ["day"])
    s = spent(quotas, book.users["u"], now)
    assert s is not None and s.quota == quotas[1] and s.reset_s == 11.5 * 3600
