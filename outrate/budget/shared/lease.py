"""The global half of a shared budget: one GCRA per user kept in Redis.

Engines never ask Redis per token. A lease thread in each engine leases
credit for every user that needs it once per lease interval, all in one
pipelined round trip (outrate.budget.shared.runner). Users fall into `GROUPS` fixed groups
by a hash of their id; one `LEASE_SCRIPT` call serves up to `MAX_BATCH` users
of one group, so 10,000 users cost at most a few dozen script calls, not
10,000. The script runs atomically in Redis with the server's `TIME`, so
engine clocks never matter.

State per user, both keys under its group's hash tag, so Redis Cluster keeps
a group in one slot and every call touches one slot (`user_keys`):

- `outrate:{g:<n>}:t:<user>`: the theoretical arrival time in whole
  microseconds of server time (absent = a fresh user). Lua numbers are
  doubles, exact for integers below 2**53: a TAT in microseconds (~1.7e15)
  is, one in the Limiter's scaled nanosecond units is not. A grant of k
  tokens moves the TAT by `ceil(k * 1e6 * q / p)` us for a rate p/q, a
  refund moves it back by the floor of the same: rounding never favours the
  user, and it happens once per grant, not per token.
- `outrate:{g:<n>}:d:<user>`: each engine's demand (its live requests of
  the user) with an expiry, one line `demand:expiry_us:engine` per engine,
  so the script can size this engine's fair slice. A string, not a hash, so
  one `MGET` reads every user's state of a call.

Both keys carry a TTL: a user who leaves leaves nothing behind.

And one hash per deployment, `outrate:{engines}`: each engine's heartbeat
(its expiry and its policy's sha256), plus `outrate:{engines}:<id>`, a key
with a TTL per engine for people looking with redis-cli.

Nothing here runs on the scheduler's thread; redis is imported lazily.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from outrate.budget.shared.scripts import HEARTBEAT_SCRIPT, LEASE_SCRIPT
from outrate.budget.shared.url import PASSWORD_ENV as PASSWORD_ENV  # (re-exported)
from outrate.budget.shared.url import check_url as check_url
from outrate.budget.shared.url import redact_url as redact_url
from outrate.budget.shared.url import split_password as split_password
from outrate.env import Env

if TYPE_CHECKING:
    from outrate.budget.limiter import Limit

PREFIX = "outrate"
ENGINES_KEY = f"{PREFIX}:{{engines}}"
US_PER_S = 1_000_000
MAX_EXACT = 2**53
"""Lua numbers are doubles: every integer the scripts compute must stay below."""

MAX_TOKENS = 1_000_000
"""Most tokens one call grants or refunds."""
MAX_HORIZON_US = 1_000_000
"""Longest lease horizon (1 s)."""
MAX_DEMAND = 1024
"""Demand (live requests) one engine reports per user is capped here."""

GROUPS = 64
"""Users are spread over this many hash-tag groups (part of the key layout:
every engine sharing a store must agree). Enough for the groups to spread
over a cluster's shards, few enough that a round needs few script calls."""
MAX_BATCH = 256
"""Most users one script call serves: Redis runs a script alone, so one call
holds it for a few ms at most (11-17 us of Redis CPU per user measured on a
busy 2-core VM)."""


def group_of(user: str) -> int:
    """The user's group: CRC-32 of its UTF-8 id, the same in every engine."""
    return zlib.crc32(user.encode()) % GROUPS


def user_keys(user: str) -> tuple[str, str]:
    """(tat key, demand key) of one user, under its group's hash tag. The
    id follows the tag, so no character of it can change the slot."""
    base = f"{PREFIX}:{{g:{group_of(user)}}}"
    return f"{base}:t:{user}", f"{base}:d:{user}"


def engine_key(engine_id: str) -> str:
    return f"{ENGINES_KEY}:{engine_id}"


class Units(NamedTuple):
    """A limit in the scripts' integers: rate p/q tokens/s is one token per
    `num / p` microseconds (num = 1e6 * q); the burst in whole microseconds
    (rounded down: the store never allows more than the policy says)."""

    p: int
    num: int
    tol_us: int

    @classmethod
    def of(cls, limit: Limit) -> Units:
        assert limit.rate is not None
        p, q = limit.rate.numerator, limit.rate.denominator
        num = US_PER_S * q
        tol_us = limit.burst_ns // 1000
        # Largest products the script forms: k * num (k <= MAX_TOKENS),
        # horizon * p * demand, room * p (room <= max(tol, horizon)).
        if (
            MAX_TOKENS * num >= MAX_EXACT
            or MAX_HORIZON_US * p * MAX_DEMAND >= MAX_EXACT
            or tol_us * p >= MAX_EXACT
        ):
            raise ValueError(f"rate {limit.rate} cannot be kept exactly in the store's integers")
        return cls(p, num, tol_us)

    def us_for(self, tokens: float) -> int:
        """Microseconds of the global schedule `tokens` tokens take (rounded up)."""
        return -(-int(tokens * self.num) // self.p)


class Grant(NamedTuple):
    granted: int
    fair: int
    """This engine's fair slice for the horizon (tokens)."""
    wait_us: int
    """Until a call would be granted a token again (0: now)."""
    demand: int
    """Every engine's demand for the user (live requests)."""
    now_us: int
    """Redis server time of the grant (TIME, in microseconds)."""


class LeaseCall(NamedTuple):
    user: str
    units: Units
    demand: int
    credit: int
    want: int
    refund: int
    horizon_us: int
    debt_us: int = 0
    register: bool = True
    """Write this engine's demand (new, changed or due for renewal)."""


class RedisLink:
    """One engine's connection to Redis, used only by its lease thread.

    Timeouts are short and the client never retries on its own: a failed
    round trip is retried by the next lease round, and an engine whose store
    does not answer within `timeout_s` enforces its fallback instead.
    """

    def __init__(self, url: str, password: str | None = None, timeout_s: float = 0.5) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        check_url(url)
        bare, in_url = split_password(url)  # the URL's password first, as redis-py would
        password = in_url or password or Env.read().store_password or None
        kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        if password is not None:
            kwargs["password"] = password
        self.url = redact_url(url)
        self.client = redis.Redis.from_url(bare, **kwargs)
        self._lease_sha: str | None = None
        self._beat_sha: str | None = None
        self._users: dict[tuple[str, Units], tuple[bytes, bytes]] = {}
        """Per user and limit: its two keys and its limit, packed."""
        self.script_calls = 0
        """Lease script calls sent (a round's users, batched by group)."""

    def load(self) -> None:
        """Load both scripts (after a start or a Redis restart)."""
        self._lease_sha = self.client.script_load(LEASE_SCRIPT)
        self._beat_sha = self.client.script_load(HEARTBEAT_SCRIPT)

    def ping(self) -> None:
        self.client.ping()
        self.load()

    def round_trip(
        self,
        engine_id: str,
        calls: Sequence[LeaseCall],
        demand_ttl_us: int,
        beat: tuple[str, int] | None = None,
    ) -> tuple[list[Grant], list[tuple[str, str]] | None]:
        """All lease calls (and a heartbeat) in one pipelined round trip:
        one script call per group of users (`batches`).

        `beat` is (policy sha256, ttl_us; 0 leaves). Returns the grants in call
        order and, with `beat`, the live engines as (id, policy sha256).
        Raises redis errors (the caller counts them).
        """
        from redis.exceptions import NoScriptError

        groups = batches(calls)
        for attempt in (0, 1):
            if self._lease_sha is None:
                self.load()
            parts = [self._lease_call(engine_id, calls, g, demand_ttl_us) for g in groups]
            if beat is not None:
                sha, ttl_us = beat
                parts.append(
                    _pack(
                        b"EVALSHA",
                        self._beat_sha,
                        2,
                        ENGINES_KEY,
                        engine_key(engine_id),
                        engine_id,
                        sha,
                        ttl_us,
                    )
                )
            replies = self._send(b"".join(parts), len(parts))
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                self._lease_sha = None  # Redis restarted and forgot the scripts
                continue
            for r in replies:
                if isinstance(r, Exception):
                    raise r
            break
        self.script_calls += len(groups)
        grants: list[Grant | None] = [None] * len(calls)
        for g, r in zip(groups, replies[: len(groups)], strict=True):
            *v, now = map(int, r.split())
            for j, i in enumerate(g):
                k = 4 * j
                grants[i] = Grant(v[k], v[k + 1], v[k + 2], v[k + 3], now)
        engines = None
        if beat is not None:
            raw = replies[-1]
            engines = [(_s(raw[i]), _s(raw[i + 1])) for i in range(0, len(raw), 2)]
        return grants, engines  # type: ignore[return-value]  # every index is in one batch

    def _lease_call(
        self, engine_id: str, calls: Sequence[LeaseCall], batch: list[int], demand_ttl_us: int
    ) -> bytes:
        """One EVALSHA for a batch of users of one group, in RESP, packed by
        hand (redis-py's pipeline spent ~40 us per command packing). Each
        user's keys and limit are packed once and cached, and the rest of its
        arguments is one string of integers: one argument per user, not ten,
        for Python to pack and for Redis to parse."""
        users = self._users
        keys = []
        args = []
        for i in batch:
            c = calls[i]
            cached = users.get((c.user, c.units))
            if cached is None:
                if len(users) > 100_000:
                    users.clear()
                tat, dem = user_keys(c.user)
                u = c.units
                cached = (_bulk(tat) + _bulk(dem), b"%d %d %d" % (u.p, u.num, u.tol_us))
                users[(c.user, c.units)] = cached
            keys.append(cached[0])
            one = b"%d %d %d %d %s %d %d %d" % (
                c.demand,
                c.credit,
                c.want,
                c.refund,
                cached[1],
                c.horizon_us,
                c.debt_us,
                c.register,
            )
            args.append(b"$%d\r\n%s\r\n" % (len(one), one))
        n = len(batch)
        return b"".join(
            (
                b"*%d\r\n" % (5 + 3 * n),
                _bulk(b"EVALSHA"),
                _bulk(self._lease_sha or ""),  # loaded by round_trip before any call
                _bulk(2 * n),
                *keys,
                _bulk(engine_id),
                _bulk(demand_ttl_us),
                *args,
            )
        )

    def _send(self, data: bytes, n: int) -> list[Any]:
        """Write a packed pipeline, read its `n` replies (error replies as
        exception objects, like `execute(raise_on_error=False)`)."""
        from redis.exceptions import ResponseError

        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([data])  # type: ignore[no-untyped-call]
            replies: list[Any] = []
            for _ in range(n):
                try:
                    replies.append(conn.read_response())
                except ResponseError as e:
                    replies.append(e)
            return replies
        except BaseException:
            conn.disconnect()  # type: ignore[no-untyped-call]  # a half-read pipeline cannot be reused
            raise
        finally:
            pool.release(conn)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


def batches(calls: Sequence[LeaseCall]) -> list[list[int]]:
    """Indexes of `calls` per script call: the users of one group (so one
    cluster slot), at most `MAX_BATCH` per call."""
    by_group: dict[int, list[int]] = {}
    for i, c in enumerate(calls):
        by_group.setdefault(group_of(c.user), []).append(i)
    return [
        idx[j : j + MAX_BATCH] for idx in by_group.values() for j in range(0, len(idx), MAX_BATCH)
    ]


def _bulk(x: bytes | str | int) -> bytes:
    b = x if isinstance(x, bytes) else str(x).encode()
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _pack(*args: bytes | str | int | None) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a if a is not None else b"") for a in args)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
