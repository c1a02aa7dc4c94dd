"""Quota usage shared through the store (`quota:` with `--outrate-store`): `UsageLink`.

Each engine counts its users' usage in its own `QuotaBook`
(outrate.budget.quota), on the scheduler's thread, as without a store. The
quota file's thread (outrate.budget.quotafile.QuotaSaver) calls `sync`
every save: it writes this engine's running count of each window to the
store and reads back each user's count over every engine, in one pipelined
round trip (one `USAGE_SCRIPT` call per group of users, the groups and hash
tags of the lease keys: outrate.budget.shared.lease).

In the store, per user, one hash `outrate:{g:<n>}:q:<user>` with one field
per engine and window, `kind/window/start/<quota id>` -> that engine's
count. An engine writes its count, never a difference, and never lowers it,
so a retried call adds nothing, an engine restarted with its quota id (kept
in its quota file) goes on where it was, one restarted without it leaves its
old count in place (a restart never gives a fresh window), and a store that
lost its state (a restart without persistence) is written back whole by
the engines running at the next full sync. The hash expires `USAGE_TTL_MS`
after its last write (a month and a few days: the longest window).

Away from the store nothing stops: the engine counts on, and what the other
engines had counted when it last answered stays in its view
(the quota file's `users`, which the API server reads), so the API server keeps refusing the
users spent by then; once the store answers, a full sync settles every count.

An operator's reset (`reset`) deletes the user's hash and sets its reset
mark (`outrate:{g:<n>}:qr:<user>`, server time): each engine forgets its own
count at its next call, and nothing it counted before is written again.

Runs on the quota file's thread only; redis is imported lazily.
"""

from __future__ import annotations

from outrate.budget.quota import Usage
from outrate.budget.shared.lease import GROUP_SLOTS, MAX_BATCH, PREFIX, group_of
from outrate.budget.shared.nodes import Part, pack, sha1
from outrate.budget.shared.scripts import RESET_SCRIPT, USAGE_SCRIPT
from outrate.budget.shared.topology import open_nodes
from outrate.budget.shared.url import check_url, redact_url, split_password, split_ssl_password
from outrate.env import Env

USAGE_TTL_MS = 35 * 86_400_000
"""A user's usage hash lives this long past its last write: the longest
window (a month) and a few days."""
USAGE_SHA = sha1(USAGE_SCRIPT)
RESET_SHA = sha1(RESET_SCRIPT)


def usage_keys(user: str) -> tuple[str, str]:
    """(usage hash, reset mark) of one user, under its group's hash tag."""
    base = f"{PREFIX}:{{g:{group_of(user)}}}"
    return f"{base}:q:{user}", f"{base}:qr:{user}"


class Totals:
    """What one sync learnt of a user: the reset mark, and per window key
    (`output/day`) its start and the count over every engine."""

    __slots__ = ("mark", "usage")

    def __init__(self, mark: int, usage: Usage) -> None:
        self.mark = mark
        self.usage = usage


class UsageLink:
    """The quota thread's connection to the store (its own: it never waits
    behind a lease round, nor a lease round behind it)."""

    def __init__(self, url: str, quota_id: str = "", timeout_s: float = 0.5) -> None:
        check_url(url)
        bare, in_url = split_password(url)
        bare, ssl_in_url = split_ssl_password(bare)
        env = Env.read()
        password = in_url or env.store_password or None
        ssl_password = ssl_in_url or env.store_ssl_password or None
        self.url = redact_url(url)
        self.quota_id = quota_id
        self.nodes = open_nodes(
            bare, password, timeout_s, (USAGE_SCRIPT, RESET_SCRIPT), GROUP_SLOTS, ssl_password
        )
        self._connected = False

    def sync(self, rows: dict[str, Usage], applied: dict[str, int]) -> dict[str, Totals]:
        """Write `rows` (user -> this engine's count per window key, as
        [start, count]) and return what every engine counted of those
        users, in the same windows. `applied`: the reset mark each user's
        counts follow (0: none). Raises the first error (the caller counts
        it and keeps counting locally)."""
        if not self._connected:
            self.nodes.connect()
            self._connected = True
        users = [u for u, r in rows.items() if r]
        by_group: dict[int, list[str]] = {}
        for u in users:
            by_group.setdefault(group_of(u), []).append(u)
        batches = [
            (g, us[i : i + MAX_BATCH])
            for g, us in by_group.items()
            for i in range(0, len(us), MAX_BATCH)
        ]
        parts = []
        for g, batch in batches:
            keys: list[str] = []
            args: list[str] = []
            for u in batch:
                keys += usage_keys(u)
                row = rows[u]
                words = [str(applied.get(u, 0)), str(len(row))]
                for key, (start, count) in sorted(row.items()):
                    words += [key, str(int(start)), str(int(count))]
                args.append(" ".join(words))
            data = pack("EVALSHA", USAGE_SHA, len(keys), *keys, self.quota_id, USAGE_TTL_MS, *args)
            parts.append(Part(GROUP_SLOTS[g], data))
        replies = self.nodes.send(parts)
        out: dict[str, Totals] = {}
        error: Exception | None = None
        for (_, batch), r in zip(batches, replies, strict=True):
            if isinstance(r, Exception):
                self._connected = False
                error = error or r
                continue
            text = r.decode() if isinstance(r, bytes) else str(r)
            for u, line in zip(batch, text.split("\n"), strict=True):
                mark, *totals = (int(x) for x in line.split())
                keys = sorted(rows[u])
                usage = {k: [int(rows[u][k][0]), t] for k, t in zip(keys, totals, strict=True)}
                out[u] = Totals(mark, usage)
        if error is not None:
            raise error
        return out

    def reset(self, user: str) -> int:
        """The operator's reset of `user` (every engine's count): the mark, server us."""
        if not self._connected:
            self.nodes.connect()
            self._connected = True
        hkey, rkey = usage_keys(user)
        part = Part(
            GROUP_SLOTS[group_of(user)], pack("EVALSHA", RESET_SHA, 2, hkey, rkey, USAGE_TTL_MS)
        )
        (r,) = self.nodes.send([part])
        if isinstance(r, Exception):
            self._connected = False
            raise r
        return int(r)

    def close(self) -> None:
        try:
            self.nodes.close()
        except Exception:
            pass
