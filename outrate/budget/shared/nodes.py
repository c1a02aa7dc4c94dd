"""Where the lease thread's commands go: one Redis server, the primary its
Sentinels name, or the shards of a Redis Cluster (which of the three a URL
names: outrate.budget.shared.topology.open_nodes).

- `Server` (redis://, rediss://, unix://): redis-py's client, one connection.
- `Sentinels` (redis+sentinel://): redis-py's Sentinel client. It asks the
  Sentinels for the primary whenever it connects, so a connection lost to a
  failover, or a primary that answers as a replica (READONLY: it was
  demoted), makes the next round find the new one.
- `Shards` (redis+cluster://): redis-py's `RedisCluster` for the topology
  (which primary serves which hash slot), and pipelining of its own: a round
  writes one pipeline to every primary it needs, then reads them all, so it
  costs one round trip per shard, in parallel (redis-py's cluster pipeline
  would pack each command at ~40 us).

Each command is a `Part`: packed RESP and the hash slot of its keys (each
lease call stays in one slot: outrate.budget.shared.lease). `send` returns
one reply per part; an error reply, or the failure of the node a part went
to, comes back as an exception object in its place. MOVED (a slot moved, or
a replica took over) and ASK (a slot moving) are followed within the same
send, and so is NOSCRIPT (a node that never saw the scripts: a new primary):
each follow is one more round trip for the parts concerned only, at most
`MAX_FOLLOWS` times. The counts (`redirects`, `failovers`) and which nodes
serve now (`primaries`) are for the metrics; `news` holds the transitions for
the lease thread to log, once each.

Runs on the lease thread only; redis is imported lazily.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from outrate.budget.shared.url import split_password

MAX_FOLLOWS = 3
"""Redirects and script loads followed in one send before a part fails."""


class Part(NamedTuple):
    slot: int
    data: bytes
    """One command, packed (RESP)."""


def sha1(script: str) -> str:
    """What SCRIPT LOAD answers for `script`: EVALSHA needs no round trip to learn it."""
    return hashlib.sha1(script.encode()).hexdigest()


class WrongKind(Exception):
    """The store is another kind than its URL says (a cluster node behind redis://)."""


def refused(e: BaseException) -> bool:
    """A store that answers but will not serve this engine as configured (a
    wrong password, missing ACL rights, a cluster node behind a plain URL or
    a plain server behind a cluster URL): waiting does not mend it."""
    from redis.exceptions import (
        AskError,
        AuthenticationError,
        AuthorizationError,
        NoPermissionError,
        RedisClusterException,
    )

    if isinstance(
        e, AuthenticationError | AuthorizationError | NoPermissionError | AskError | WrongKind
    ):
        return True
    return isinstance(e, RedisClusterException) and "not enabled" in str(e)


def pack(*args: bytes | str | int) -> bytes:
    """One command in RESP, as the socket sends it."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


ASKING = pack(b"ASKING")


class Nodes:
    """What the three kinds share: routing a send, following, counting."""

    kind = "redis"
    follows_moved = False

    def __init__(self, scripts: Sequence[str]) -> None:
        self.scripts = tuple(scripts)
        self.redirects = {"moved": 0, "ask": 0, "tryagain": 0}
        """MOVED and ASK redirects followed, TRYAGAIN replies left for the next round."""
        self.failovers = 0
        """Primaries in use seen replaced by another node."""
        self.news: list[str] = []
        """Transitions not yet logged (the lease thread logs and clears them)."""

    # -- what a kind provides ------------------------------------------------------

    def connect(self) -> None:
        """Reach the store (and learn its topology); raises on failure."""
        raise NotImplementedError

    def pool_for(self, slot: int) -> Any:
        """The connection pool of the primary serving `slot`."""
        raise NotImplementedError

    def primaries(self) -> list[str]:
        """host:port of each primary serving this engine's keys now."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _ready(self) -> None:
        """Before each send: what a kind must know first (raises if it cannot)."""

    def _sent(self, failed: list[Any]) -> None:
        """After each send, with the pools of the nodes that did not answer."""

    def _moved(self, e: Any) -> None:
        """Follow a MOVED redirect: update the slot map (cluster only)."""

    def _pool_at(self, host: str, port: int) -> Any:
        raise NotImplementedError

    # -- sending -------------------------------------------------------------------

    def send(self, parts: Sequence[Part]) -> list[Any]:
        from redis.exceptions import MovedError, NoScriptError

        try:
            self._ready()
        except Exception as e:
            return [e] * len(parts)
        replies: list[Any] = [None] * len(parts)
        todo = list(range(len(parts)))
        asked: dict[int, Any] = {}  # part -> the pool an ASK named
        failed: list[Any] = []
        for attempt in range(MAX_FOLLOWS + 1):
            jobs: dict[int, tuple[Any, list[int]]] = {}
            for i in todo:
                try:
                    pool = asked[i] if i in asked else self.pool_for(parts[i].slot)
                except Exception as e:  # a slot no node serves (a shard down)
                    replies[i] = e
                    continue
                jobs.setdefault(id(pool), (pool, []))[1].append(i)
            todo = []
            for pool, idx, got in _exchange(list(jobs.values()), parts, asked):
                if isinstance(got, Exception):
                    failed.append(pool)
                for i, r in zip(
                    idx, got if isinstance(got, list) else [got] * len(idx), strict=True
                ):
                    replies[i] = r
                    asked.pop(i, None)
                    if attempt == MAX_FOLLOWS or not isinstance(r, Exception):
                        continue
                    if isinstance(r, NoScriptError):
                        self._load(pool)
                        todo.append(i)
                    elif isinstance(r, MovedError) and self.follows_moved:
                        self.redirects["moved"] += 1
                        self._moved(r)
                        todo.append(i)
                    elif _is_ask(r) and self.follows_moved:
                        self.redirects["ask"] += 1
                        asked[i] = self._pool_at(r.host, r.port)  # type: ignore[attr-defined]
                        todo.append(i)
            if not todo:
                break
        self._sent(failed)
        return replies

    def _load(self, pool: Any) -> None:
        import redis

        client = redis.Redis(connection_pool=pool)
        for script in self.scripts:
            client.script_load(script)


def text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _is_ask(r: Any) -> bool:
    from redis.exceptions import AskError, MovedError

    return isinstance(r, AskError) and not isinstance(r, MovedError)


def _exchange(
    jobs: list[tuple[Any, list[int]]], parts: Sequence[Part], asked: dict[int, Any]
) -> list[tuple[Any, list[int], list[Any] | Exception]]:
    """One pipelined round trip to each pool at once: write every pool's
    parts, then read each pool's replies (error replies as exception
    objects, like `execute(raise_on_error=False)`). A pool whose connection
    fails gets that exception for all its parts; the others are unaffected.
    A part sent after an ASK goes behind an ASKING (its reply is dropped)."""
    from redis.exceptions import ResponseError

    out: list[tuple[Any, list[int], list[Any] | Exception]] = []
    open_: list[tuple[Any, Any, list[int]]] = []
    for pool, idx in jobs:
        conn = None
        try:
            conn = pool.get_connection()
            data = b"".join((ASKING if i in asked else b"") + parts[i].data for i in idx)
            conn.send_packed_command([data])
            open_.append((pool, conn, idx))
        except Exception as e:
            if conn is not None:
                conn.disconnect()
                pool.release(conn)
            out.append((pool, idx, e))
    for pool, conn, idx in open_:
        try:
            replies: list[Any] = []
            for i in idx:
                for _ in range(2 if i in asked else 1):
                    try:
                        r = conn.read_response()
                    except ResponseError as e:
                        r = e
                replies.append(r)
            out.append((pool, idx, replies))
        except Exception as e:
            conn.disconnect()  # a half-read pipeline cannot be reused
            out.append((pool, idx, e))
        finally:
            pool.release(conn)
    return out


class Server(Nodes):
    """One Redis server: every slot is its."""

    def __init__(self, url: str, password: str | None, kw: dict[str, Any], scripts: Sequence[str]):
        import redis

        super().__init__(scripts)
        bare, _ = split_password(url)
        if password is not None:
            kw = {**kw, "password": password}
        self.client = redis.Redis.from_url(bare, **kw)
        where = self.client.connection_pool.connection_kwargs
        self.name = where.get("path") or f"{where.get('host')}:{where.get('port')}"

    def connect(self) -> None:
        self.client.ping()
        try:
            cluster = self.client.info("cluster").get("cluster_enabled")
        except Exception:  # INFO refused (a proxy, ACLs): nothing to tell
            return
        if cluster:
            raise WrongKind(
                f"{self.name} is a Redis Cluster node: name the cluster with "
                "redis+cluster://HOST:PORT[,HOST:PORT...]/"
            )

    def pool_for(self, slot: int) -> Any:
        return self.client.connection_pool

    def primaries(self) -> list[str]:
        return [self.name]

    def close(self) -> None:
        self.client.close()
