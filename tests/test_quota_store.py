"""Quota usage shared through the store (outrate/budget/shared/usage.py,
outrate/budget/quotafile.py with a store), on a real redis-server: two
engines' books counting one user's quota, what each engine's quota file (the
API server's view) says, restarts, an outage and a reset, and what the
operator's `outrate quota --store` reads and resets there. The scheduler's
side (what is counted) is tests/test_e2e_quota.py's and test_quota.py's;
here each engine is its `QuotaBook` and `QuotaSaver`, stepped by hand."""

from __future__ import annotations

import calendar
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("redis")

from redis_support import PLAIN_PASSWORD, SECRET, RedisServer  # noqa: E402
from serverproc import free_port  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from outrate.budget.quota import Quota, QuotaBook, spent, window_bounds  # noqa: E402
from outrate.budget.quotafile import FULL_SYNC_S, QuotaSaver, request_reset  # noqa: E402
from outrate.budget.shared.usage import SCAN_COUNT, UsageLink, usage_keys, user_of  # noqa: E402
from outrate.cli import app  # noqa: E402
from outrate.env import STORE_PASSWORD  # noqa: E402

pytestmark = pytest.mark.waits  # make test's waits lane (tests/lanes.py)

NOW = calendar.timegm((2026, 12, 4, 12, 0, 0))
DAY = "output/day"
QUOTA = Quota("output", 1000, "day")


class Engine:
    """One engine's quota side: its book (the scheduler adds to it), its
    quota file and the saver that syncs it with the store."""

    def __init__(self, path: Path, url: str, now: float = NOW) -> None:
        self.path = path
        self.url = url
        self.mono = 0.0
        self.told: list[str] = []
        self.book = QuotaBook(clock=lambda: now)
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


@pytest.fixture
def locked(tmp_path):
    """A redis-server that wants a password (PLAIN_PASSWORD)."""
    s = RedisServer(tmp_path / "locked", password=PLAIN_PASSWORD).start()
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


def quota(*args: object) -> tuple[int, str, str]:
    """`outrate quota ARGS`: (exit code, stdout, stderr)."""
    result = CliRunner().invoke(app, ["quota", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def test_outrate_quota_lists_and_resets_the_stores_usage(tmp_path, monkeypatch, locked):
    """`outrate quota --store URL` on what two engines synced (their savers'
    real `UsageLink.sync`), the password from OUTRATE_STORE_PASSWORD as the
    engines read it: each user's count over both engines per window, in
    the lines `--file` prints (an engine's file that learnt both counts
    prints the same), with `--policy` the quota in force and what is left;
    users found by SCAN, page after page, never KEYS. `--reset alice`
    empties her in the store: listed no more, and each engine forgets its
    own count at its next full sync and writes none of it back."""
    monkeypatch.setenv(STORE_PASSWORD, PLAIN_PASSWORD)
    url = locked.bare_url
    now = time.time()
    a, b = Engine(tmp_path / "a.json", url, now), Engine(tmp_path / "b.json", url, now)
    a.add(600)
    b.add(300)
    a.add(7, user="bob")
    many = [f"u{i:04}" for i in range(SCAN_COUNT * 2)]  # more than one SCAN page
    for user in many:
        b.add(1, user=user)
    a.save()
    b.save()
    a.save(FULL_SYNC_S)  # a's file learns b's 300 of alice's (the others are idle on a)
    resets = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(window_bounds("day", now)[1]))
    code, out, err = quota("--store", url)
    lines = out.splitlines()
    assert (code, err, len(lines)) == (0, "", 2 + len(many))
    assert lines[:2] == [
        f"alice  {DAY}  900 used  resets {resets}",
        f"bob  {DAY}  7 used  resets {resets}",
    ]
    assert lines[2:] == [f"{u}  {DAY}  1 used  resets {resets}" for u in many]
    assert quota("--file", a.path) == (0, "\n".join(lines[:2]) + "\n", "")
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\ndefault: 20\nusers:\n  alice: {rate: 5, quota: {output: 1000/day}}\n"
    )
    code, out, _ = quota("--store", url, "--policy", policy)
    assert code == 0
    assert out.splitlines()[0] == (
        f"alice  {DAY}  900 used of 1000 (100 left, users.alice)  resets {resets}"
    )
    assert quota("--file", a.path, "--policy", policy)[1].splitlines() == out.splitlines()[:2]
    stats = locked.client().info("commandstats")
    assert stats["cmdstat_scan"]["calls"] >= 2 and "cmdstat_keys" not in stats

    assert quota("--store", url, "--reset", "alice") == (0, "reset 'alice'\n", "")
    assert quota("--store", url, "--reset", "carol") == (
        0, "reset 'carol' (no usage in the store)\n", ""
    )  # fmt: skip
    assert quota("--store", url)[1].splitlines()[0] == f"bob  {DAY}  7 used  resets {resets}"
    a.save(FULL_SYNC_S)  # alice idle on both: each learns of the reset at its next full sync
    b.save(FULL_SYNC_S)
    assert (a.own(), b.own(), a.view(), b.view()) == (0, 0, 0, 0)
    assert not quota("--store", url)[1].startswith("alice")  # nothing written back
    a.saver.stop()
    b.saver.stop()


def test_outrate_quota_says_in_one_line_why_the_store_is_out_of_reach(monkeypatch, locked):
    """Exit 1 and one line naming the store (its password never shown), no
    traceback: a URL that is none of the store's forms, one redis-py cannot
    read, a store that is not there, a store that wants a password. And a
    user id under `}:q:` of the pattern is still found for its own key."""
    monkeypatch.delenv(STORE_PASSWORD, raising=False)
    port = free_port()
    cases = {
        "http://127.0.0.1:6379": "outrate quota: --store must be a redis://HOST:PORT/DB URL",
        f"redis://:{PLAIN_PASSWORD}@127.0.0.1:port/0": (
            "outrate quota: --store 'redis://***@127.0.0.1:port/0': Port could not be cast"
        ),
        "redis+cluster://127.0.0.1/": "outrate quota: --store 'redis+cluster://127.0.0.1/': "
        "'127.0.0.1' is not HOST:PORT",
        f"redis://:{PLAIN_PASSWORD}@127.0.0.1:{port}/0": (
            f"outrate quota: budget store redis://***@127.0.0.1:{port}/0: Error 111 connecting"
        ),
    }
    for url, begins in cases.items():
        for extra in ((), ("--reset", "alice")):
            code, out, err = quota("--store", url, *extra)
            assert (code, out) == (1, ""), (url, err)
            assert err.startswith(begins) and err.count("\n") == 1, err
            assert SECRET not in err and "Traceback" not in err
    code, _, err = quota("--store", locked.bare_url)
    assert code == 1 and err.startswith(f"outrate quota: budget store {locked.bare_url}: ")
    assert err.count("\n") == 1 and "auth" in err.lower(), err  # (words: the server's)
    odd = "a}:q:b"
    assert user_of(usage_keys(odd)[0]) == odd and user_of(usage_keys(odd)[1]) is None


def test_outrate_quota_reads_every_shard_of_a_cluster(tmp_path):
    """On a Redis Cluster the users are spread over the shards' primaries:
    `--store redis+cluster://` SCANs each, lists every user once, and
    resets one on the shard that holds it."""
    from redis_cluster_support import Cluster

    cluster = Cluster(tmp_path / "cluster", primaries=3, replicas=0).start()
    try:
        engine = Engine(tmp_path / "a.json", cluster.url, time.time())
        users = [f"u{i:03}" for i in range(300)]
        for n, user in enumerate(users, 1):
            engine.add(n, user=user)
        engine.save()
        assert len(engine.saver.share.nodes.primaries()) == 3  # the groups on every shard
        lines = quota("--store", cluster.url)[1].splitlines()
        assert [line.split("  ")[:3] for line in lines] == [
            [u, DAY, f"{n} used"] for n, u in enumerate(users, 1)
        ]
        assert quota("--store", cluster.url, "--reset", "u007") == (0, "reset 'u007'\n", "")
        assert len(quota("--store", cluster.url)[1].splitlines()) == len(users) - 1
        engine.saver.stop()
    finally:
        cluster.stop()
