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

The operator's command (`outrate quota --store`, `operator_link`) reads the
hashes themselves: every user's (`all_usage`, found by SCAN over each
primary, never KEYS, which would hold a store the engines lease from) or
one's (`usage_of`), summed over the engines.

Runs on the quota file's thread (or in the operator's command) only; redis
is imported lazily.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from outrate.budget.quota import Usage
from outrate.budget.shared.lease import GROUP_SLOTS, MAX_BATCH, PREFIX, group_of
from outrate.budget.shared.nodes import Part, WrongKind, pack, sha1, text
from outrate.budget.shared.scripts import RESET_SCRIPT, USAGE_SCRIPT
from outrate.budget.shared.topology import open_nodes
from outrate.budget.shared.url import check_url, redact_url, split_password, split_ssl_password
from outrate.env import Env
from outrate.errors import OutrateError

USAGE_TTL_MS = 35 * 86_400_000
"""A user's usage hash lives this long past its last write: the longest
window (a month) and a few days."""
USAGE_SHA = sha1(USAGE_SCRIPT)
RESET_SHA = sha1(RESET_SCRIPT)


USAGE_MATCH = f"{PREFIX}:{{g:*}}:q:*"
"""A SCAN pattern every usage hash matches (`usage_keys`)."""
SCAN_COUNT = 1000
"""Keys one SCAN call looks at (the server's hint): a page at a time, so
the engines' calls wait behind one page, never behind the whole keyspace."""


def usage_keys(user: str) -> tuple[str, str]:
    """(usage hash, reset mark) of one user, under its group's hash tag."""
    base = f"{PREFIX}:{{g:{group_of(user)}}}"
    return f"{base}:q:{user}", f"{base}:qr:{user}"


def user_of(key: str) -> str | None:
    """The user whose usage hash `key` is; None for another key `USAGE_MATCH`
    matched (a user id may hold `}:q:`: the first one ends the tag)."""
    user = key.partition("}:q:")[2]
    return user if user and usage_keys(user)[0] == key else None


def summed(fields: Any) -> Usage:
    """A usage hash's fields (HGETALL's reply: a flat list, or a mapping
    under RESP3) as the count over every engine, per window key, in its
    latest window: [start, count]. A window the engines have not yet
    cleared away (it passed) is left out; so is a field not of the script's
    form (`kind/window/start/engine`)."""
    pairs = (
        fields.items() if isinstance(fields, dict) else zip(fields[::2], fields[1::2], strict=True)
    )
    out: Usage = {}
    for field, value in pairs:
        words, count = text(field).split("/"), text(value)
        if len(words) != 4 or not words[2].isdigit() or not count.isdigit():
            continue
        key, begins, n = f"{words[0]}/{words[1]}", int(words[2]), int(count)
        row = out.get(key)
        if row is None or begins > row[0]:
            out[key] = [begins, n]
        elif begins == row[0]:
            row[1] += n
    return out


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
        self._connect()
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
        self._connect()
        hkey, rkey = usage_keys(user)
        part = Part(
            GROUP_SLOTS[group_of(user)], pack("EVALSHA", RESET_SHA, 2, hkey, rkey, USAGE_TTL_MS)
        )
        (r,) = self.nodes.send([part])
        if isinstance(r, Exception):
            self._connected = False
            raise r
        return int(r)

    def usage_of(self, users: list[str]) -> dict[str, Usage]:
        """Each of `users`' usage in the store (`summed`; {} for a user the
        store has none of), one pipelined round trip."""
        self._connect()
        parts = [Part(GROUP_SLOTS[group_of(u)], pack("HGETALL", usage_keys(u)[0])) for u in users]
        out: dict[str, Usage] = {}
        for u, r in zip(users, self.nodes.send(parts), strict=True):
            if isinstance(r, Exception):
                self._connected = False
                raise r
            out[u] = summed(r)
        return out

    def all_usage(self) -> dict[str, Usage]:
        """Every user's usage in the store, by user (those with none left
        out): SCAN over each primary that serves a group, a page at a time,
        each page's hashes read in one round trip (`usage_of`)."""
        import redis

        self._connect()
        pools = {id(p): p for p in map(self.nodes.pool_for, GROUP_SLOTS)}
        out: dict[str, Usage] = {}
        for pool in pools.values():
            client = redis.Redis(connection_pool=pool)
            cursor = None
            while cursor != 0:
                cursor, keys = client.scan(cursor or 0, match=USAGE_MATCH, count=SCAN_COUNT)
                found = [u for u in map(user_of, map(text, keys)) if u is not None]
                out.update((u, usage) for u, usage in self.usage_of(found).items() if usage)
        return out

    def _connect(self) -> None:
        if not self._connected:
            self.nodes.connect()
            self._connected = True

    def close(self) -> None:
        try:
            self.nodes.close()
        except Exception:
            pass


@contextlib.contextmanager
def operator_link(url: str, flag: str, timeout_s: float = 5.0) -> Iterator[UsageLink]:
    """A link for an operator's command (`outrate quota --store`), closed
    after, with the password as the engine reads it (the URL's, else
    `OUTRATE_STORE_PASSWORD`). Every way of not reaching the store is an
    error of one line: a URL that is not one of its forms, a ValueError
    naming `flag`; a store that does not answer (or refuses), an
    OutrateError naming it, redacted."""
    check_url(url, flag)
    try:
        from redis.exceptions import RedisClusterException, RedisError
    except ImportError as e:
        raise OutrateError(f"{flag} needs redis-py: pip install 'outrate[store]'") from e
    where = redact_url(url)
    try:
        link = UsageLink(url, timeout_s=timeout_s)
    except (ValueError, RedisError, RedisClusterException) as e:  # redis-py reads the URL too
        raise OutrateError(f"{flag} {where!r}: {_line(e)}") from e
    try:
        yield link
    except (RedisError, RedisClusterException, WrongKind, OSError) as e:
        raise OutrateError(f"budget store {where}: {_line(e)}") from e
    finally:
        link.close()


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
