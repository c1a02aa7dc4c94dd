"""Quota usage shared through the store (outrate/budget/shared/usage.py,
outrate/budget/quotafile.py with a store), on a real redis-server: two
engines' books counting one user's quota, what each engine's quota file (the
API server's view) says, restarts, an outage and a reset. The scheduler's
side (what is counted) is tests/test_e2e_quota.py's and test_quota.py's;
here each engine is its `QuotaBook` and `QuotaSaver`, stepped by hand."""

from __future__ import annotations

import calendar
import json
from pathlib import Path

import pytest

pytest.importorskip("redis")

from redis_support import RedisServer  # noqa: E402

from outrate.budget.quota import Quota, QuotaBook, spent  # noqa: E402
from outrate.budget.quotafile import FULL_SYNC_S, QuotaSaver, request_reset  # noqa: E402
from outrate.budget.shared.usage import UsageLink, usage_keys  # noqa: E402

NOW = calendar.timegm((2026, 12, 4, 12, 0, 0))
DAY = "output/day"
QUOTA = Quota("output", 1000, "day")


class Engine:
    """One engine's quota side: its book (the scheduler adds to it), its
    quota file and the saver that syncs it with the store."""

    def __init__(self, path: Path, url: str) -> None:
        self.path = path
        self.url = url
        self.mono = 0.0
        self.told: list[str] = []
        self.book = QuotaBook(clock=lambda: NOW)
        self.saver = QuotaSaver(
            str(path),
            self.book,
            share=UsageLink(url),
            on_share=self.told.append,
            clock=lambda: self.mono,
        )

    def add(self, tokens: int, user: str = "alice") -> None:
        self.book.add(user, "output", tokens, ["day"])

    def save(self, later_s: float = 1.0) -> None:
        self.mono += later_s
        self.saver.save()

    def view(self, user: str = "alice") -> int:
        """What the API server beside this engine reads: the file's count."""
        users = json.loads(self.path.read_text())["users"]
        return users.get(user, {}).get(DAY, [0, 0])[1]

    def own(self, user: str = "alice") -> int:
        return self.book.used(user, "output", "day")

    def restart(self) -> Engine:
        self.saver.stop()
        return Engine(self.path, self.url)


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def test_two_engines_share_one_quota(tmp_path, server):
    """Each engine counts its own; each file shows the count over both, so
    either API server refuses alice once both together spent her quota.
    Saving again adds nothing (an engine writes its count, not a difference)."""
    a, b = Engine(tmp_path / "a.json", server.url), Engine(tmp_path / "b.json", server.url)
    a.add(600)
    a.save()
    b.add(300)
    b.save()
    assert (a.own(), b.own()) == (600, 300)
    assert b.view() == 900  # b learnt a's 600
    a.save()
    assert a.view() == 600  # alice idle on a: not asked for until a full sync
    a.save(FULL_SYNC_S)
    assert a.view() == 900
    for _ in range(3):  # idempotent
        a.save(FULL_SYNC_S)
        b.save(FULL_SYNC_S)
    assert (a.view(), b.view()) == (900, 900)
    b.add(200)
    b.save()
    a.add(0)  # (nothing: still idle on a)
    a.save(FULL_SYNC_S)
    assert (a.view(), b.view()) == (1100, 1100)
    usage = json.loads((tmp_path / "a.json").read_text())["users"]["alice"]
    assert spent([QUOTA], usage, NOW) is not None  # a's API server refuses her next request
    fields = server.client().hgetall(usage_keys("alice")[0])
    assert sorted(int(v) for v in fields.values()) == [500, 600]  # one count per engine
    a.saver.stop()
    b.saver.stop()


def test_a_restart_never_gives_a_fresh_window(tmp_path, server):
    """An engine restarted with its file goes on from its own count under the
    same quota id; one restarted without it (a new disk) starts at 0 here,
    but its old count stays in the store and in everyone's total."""
    a, b = Engine(tmp_path / "a.json", server.url), Engine(tmp_path / "b.json", server.url)
    a.add(600)
    b.add(300)
    a.save()
    b.save()
    a = a.restart()
    assert a.own() == 600 and a.view() == 600  # before any sync: the file as a saved it
    a.save()  # the first sync after a start is a full one
    assert a.view() == 900
    a.add(50)
    a.save()
    assert a.view() == 950
    a.saver.stop()
    fresh = Engine(tmp_path / "a-new-disk.json", server.url)
    fresh.add(10)
    fresh.save()
    assert fresh.own() == 10 and fresh.view() == 960  # a's 650 kept, b's 300, its 10
    b.saver.stop()
    fresh.saver.stop()


def test_an_outage_counts_on_locally_and_settles_when_the_store_returns(tmp_path, server):
    """The store stops: nothing raises, each engine counts on and its file
    shows its own count plus the others' as last learnt (said once). The
    store comes back empty (a restart without persistence): the next full
    sync of each engine writes its whole count again, so the totals are
    right without anyone's usage lost."""
    a, b = Engine(tmp_path / "a.json", server.url), Engine(tmp_path / "b.json", server.url)
    a.add(400)
    b.add(300)
    a.save()
    b.save()
    a.save(FULL_SYNC_S)  # a learns b's 300
    server.stop()
    a.add(200)
    b.add(100)
    a.save()
    b.save()
    assert (a.view(), b.view()) == (600 + 300, 400 + 400)  # own now, the other's as learnt
    assert len(a.told) == 1 and "counting on here" in a.told[0]
    a.save()
    assert len(a.told) == 1  # once per outage
    server.start()  # empty
    a.save()  # a full sync: the first after a failure
    b.save()
    assert b.view() == 1000
    a.save(FULL_SYNC_S)  # alice idle on a: learnt at its next full sync
    assert a.view() == 1000
    assert "is back" in a.told[-1]
    # A user idle on one engine is learnt by its next full sync.
    b.add(5, user="bob")
    b.save()
    a.save(FULL_SYNC_S)
    assert a.view("bob") == 0  # a never counted bob: it does not ask for him
    a.saver.stop()
    b.saver.stop()


def test_an_operators_reset_reaches_every_engine(tmp_path, server):
    """`outrate quota --reset alice` on one engine's file: that engine resets
    her in the store, the other forgets its own count at its next sync and
    writes nothing it counted before; then both count afresh."""
    a, b = Engine(tmp_path / "a.json", server.url), Engine(tmp_path / "b.json", server.url)
    a.add(600)
    b.add(500)
    a.save()
    b.save()
    a.save(FULL_SYNC_S)
    assert a.view() == 1100
    request_reset(str(tmp_path / "a.json"), "alice")
    a.save()
    assert a.own() == 0
    b.save(FULL_SYNC_S)  # alice idle on b: it learns of the reset at its next full sync
    assert b.own() == 0 and b.view() == 0
    b.add(7)
    b.save()
    a.add(3)
    a.save()
    assert a.view() == 10
    a.saver.stop()
    b.saver.stop()
