"""Quota windows and usage (outrate/budget/quota.py): UTC calendar windows,
usage that never carries into the next window, and the spent decision."""

from __future__ import annotations

import calendar
from pathlib import Path

import pytest

from outrate.budget.quota import Quota, QuotaBook, spent, window_bounds
from outrate.budget.quotafile import QuotaSaver, read_usage, request_reset
from outrate.contract.quotas import usage_lines
from outrate.policy.pipeline import load_compiled


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


def test_the_engine_applies_a_reset_once_and_keeps_what_follows(tmp_path: Path) -> None:
    """`outrate quota --reset` (request_reset) drops the user from the file at
    once; the running engine's next save forgets its usage too, exactly once:
    what it counts afterwards, a restart included, is kept."""
    now = float(utc(2026, 12, 4, 12, 0, 0))
    path = str(tmp_path / "q.json")
    book = QuotaBook(clock=lambda: now)
    saver = QuotaSaver(path, book)
    book.add("alice", "output", 900, ["day"])
    book.add("bob", "output", 50, ["day"])
    saver.save()
    assert set(read_usage(path)[0]) == {"alice", "bob"}
    assert request_reset(path, "alice", now=now + 1)
    assert set(read_usage(path)[0]) == {"bob"}  # for a stopped engine and the API servers
    saver.save()
    assert book.used("alice", "output", "day") == 0 and book.used("bob", "output", "day") == 50
    book.add("alice", "output", 7, ["day"])
    saver.save()
    assert book.used("alice", "output", "day") == 7  # not reset twice
    restarted = QuotaBook(clock=lambda: now)
    QuotaSaver(path, restarted).save()
    assert restarted.used("alice", "output", "day") == 7
    assert not request_reset(path, "carol", now=now + 2)


def test_a_reset_of_a_stopped_engine_is_not_applied_again_at_start(tmp_path: Path) -> None:
    now = float(utc(2026, 12, 4, 12, 0, 0))
    path = str(tmp_path / "q.json")
    book = QuotaBook(clock=lambda: now)
    book.add("alice", "output", 900, ["day"])
    QuotaSaver(path, book).save()
    request_reset(path, "alice", now=now + 1)
    started = QuotaBook(clock=lambda: now)
    saver = QuotaSaver(path, started)
    started.add("alice", "output", 3, ["day"])
    saver.save()
    assert started.used("alice", "output", "day") == 3


def test_usage_lines_show_the_current_windows_and_with_a_policy_the_quota(
    tmp_path: Path,
) -> None:
    now = float(utc(2026, 12, 4, 12, 0, 0))
    path = str(tmp_path / "q.json")
    book = QuotaBook(clock=lambda: now)
    book.add("alice", "output", 900, ["day", "hour"])
    book.users["bob"] = {"output/day": [utc(2026, 12, 3), 10**6]}  # yesterday's: gone
    QuotaSaver(path, book).save()
    assert usage_lines(read_usage(path)[0], now_s=now) == [
        "alice  output/day  900 used  resets 2026-12-05T00:00:00Z",
        "alice  output/hour  900 used  resets 2026-12-04T13:00:00Z",
    ]
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\ndefault: 20\nusers:\n  alice: {rate: 5, quota: {output: 1000/day}}\n"
    )
    assert usage_lines(read_usage(path)[0], load_compiled(policy), now_s=now) == [
        "alice  output/day  900 used of 1000 (100 left, users.alice)  resets 2026-12-05T00:00:00Z",
        "alice  output/hour  900 used  resets 2026-12-04T13:00:00Z",
    ]
