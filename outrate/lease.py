"""The global half of a shared budget: one GCRA per user kept in Redis.

Engines never ask Redis per token. A lease thread in each engine calls
`LEASE_SCRIPT` once per user that needs credit, all users pipelined into one
round trip per lease interval (outrate.shared). The script runs atomically in
Redis with the server's `TIME`, so engine clocks never matter.

State per user, both keys under one hash tag so Redis Cluster keeps them in
one slot (`user_keys`):

- `outrate:{u:<user>}:tat`: the theoretical arrival time in whole
  microseconds of server time (absent = a fresh user). Lua numbers are
  doubles, exact for integers below 2**53: a TAT in microseconds (~1.7e15)
  is, one in the Limiter's scaled nanosecond units is not. A grant of k
  tokens moves the TAT by `ceil(k * 1e6 * q / p)` us for a rate p/q, a
  refund moves it back by the floor of the same: rounding never favours the
  user, and it happens once per grant, not per token.
- `outrate:{u:<user>}:dem`: each engine's demand (its live requests of the
  user) with an expiry, so the script can size this engine's fair slice.

And one hash per deployment, `outrate:{engines}`: each engine's heartbeat
(its expiry and its policy's sha256), plus `outrate:{engines}:<id>`, a key
with a TTL per engine for people looking with redis-cli.

Nothing here runs on the scheduler's thread; redis is imported lazily.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import quote, urlsplit, urlunsplit

if TYPE_CHECKING:
    from outrate.limiter import Limit

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

PASSWORD_ENV = "OUTRATE_STORE_PASSWORD"
"""Where the engine reads the store's password when the URL carries none."""

LEASE_SCRIPT = """
-- KEYS[1] tat, KEYS[2] demand (one hash tag: one slot).
-- ARGV: engine, demand, credit, want, refund, p, num, tol_us, horizon_us, debt_us,
--       demand_ttl_us, register (0: this engine's demand entry is fresh, leave it)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local eid = ARGV[1]
local dem = tonumber(ARGV[2])
local credit = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local refund = tonumber(ARGV[5])
local p = tonumber(ARGV[6])
local num = tonumber(ARGV[7])
local tol = tonumber(ARGV[8])
local horizon = tonumber(ARGV[9])
local debt = tonumber(ARGV[10])
local dttl = tonumber(ARGV[11])
local reg = ARGV[12] ~= '0'
local function floor_div(a, b) return (a - math.fmod(a, b)) / b end
local function ceil_div(a, b)
  local r = math.fmod(a, b)
  local q = (a - r) / b
  if r > 0 then q = q + 1 end
  return q
end
local tat0 = tonumber(redis.call('GET', KEYS[1]) or '0')
local tat = tat0
-- Unused credit comes back first; a refund can at most fill the bucket.
if refund > 0 then
  tat = math.max(tat - floor_div(refund * num, p), now)
end
-- After an outage: what this engine spent while Redis was away, at most
-- the whole burst (no one gets a burst on recovery).
if debt > 0 then
  tat = math.max(tat, math.min(math.max(tat, now) + debt, now + tol))
end
-- This engine's demand, and everyone's that has not expired.
local total = 0
local fields = redis.call('HGETALL', KEYS[2])
local last = 0
for i = 1, #fields, 2 do
  if fields[i] ~= eid then
    local d, x = string.match(fields[i + 1], '^(%d+):(%d+)$')
    x = tonumber(x)
    if x and x > now then
      total = total + tonumber(d)
      if x > last then last = x end
    else
      redis.call('HDEL', KEYS[2], fields[i])
    end
  end
end
if dem > 0 then
  total = total + dem
  if reg then
    local x = now + dttl
    redis.call('HSET', KEYS[2], eid, string.format('%d:%.0f', dem, x))
    if x > last then last = x end
  end
elseif #fields > 0 then
  redis.call('HDEL', KEYS[2], eid)
end
if reg and last > now then
  redis.call('PEXPIRE', KEYS[2], ceil_div(last - now, 1000))
end
-- The grant: this engine's fair slice of one horizon, less what it holds,
-- at most `want`, as many tokens as conform by now + max(burst, horizon).
-- The slice must carry the engine until its next answer, one horizon away:
-- granting only what conforms now would cap a user at a burst per round
-- trip once round trips outlast the burst. The engine paces its spending
-- locally, so tokens granted ahead are not spent ahead.
local reach = math.max(tol, horizon)
local granted = 0
local fair = want
if dem > 0 then
  if horizon > 0 then
    fair = ceil_div(horizon * p * dem, num * total)
    if fair < 1 then fair = 1 end
    if fair > want then fair = want end
  end
  local ask = fair - credit
  if ask > 0 then
    local base = math.max(tat, now)
    local room = now + reach - base
    if room >= 0 then
      local k = floor_div(room * p, num) + 1
      if k > ask then k = ask end
      granted = k
      tat = base + ceil_div(k * num, p)
    end
  end
end
if tat ~= tat0 then
  if tat > now then
    redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', ceil_div(tat - now, 1000))
  else
    redis.call('DEL', KEYS[1])
  end
end
local wait = tat - reach - now
if wait < 0 then wait = 0 end
return {granted, fair, wait, total, now}
"""

HEARTBEAT_SCRIPT = """
-- KEYS[1] the engines hash, KEYS[2] this engine's key (one hash tag: one slot).
-- ARGV: engine, policy sha256, ttl_us (0: leave)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now + ttl) .. ':' .. ARGV[2])
  redis.call('SET', KEYS[2], ARGV[2], 'PX', math.ceil(ttl / 1000))
else
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2])
end
local out = {}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local x, sha = string.match(fields[i + 1], '^(%d+):(.*)$')
  if x and tonumber(x) > now then
    out[#out + 1] = fields[i]
    out[#out + 1] = sha
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
return out
"""


def _tag(user: str) -> str:
    """The user id as a hash tag body: `{` and `}` would end the tag early."""
    return user.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def user_keys(user: str) -> tuple[str, str]:
    """(tat key, demand key) of one user: one hash tag, one cluster slot."""
    base = f"{PREFIX}:{{u:{_tag(user)}}}"
    return f"{base}:tat", f"{base}:dem"


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


# -- connection details ----------------------------------------------------------


def redact_url(url: str) -> str:
    """The URL with its password (and user) replaced: safe for logs."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))


def split_password(url: str) -> tuple[str, str | None]:
    """(URL without credentials, password or None). The username stays."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{quote(parts.username, safe='')}@" if parts.username else ""
    from urllib.parse import unquote

    bare = urlunsplit((parts.scheme, f"{user}{host}", parts.path, parts.query, parts.fragment))
    return bare, unquote(parts.password)


def check_url(url: str) -> str:
    """Raise ValueError unless `url` is a redis:// or rediss:// URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"--outrate-store must be a redis://HOST:PORT/DB, rediss:// (TLS) or unix:// URL, "
            f"got {redact_url(url)!r}"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"--outrate-store {redact_url(url)!r} names no host")
    return url


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
        if password is None and urlsplit(url).password is None:
            password = os.environ.get(PASSWORD_ENV) or None
        kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        if password is not None:
            kwargs["password"] = password
        self.url = redact_url(url)
        self.client = redis.Redis.from_url(url, **kwargs)
        self._lease_sha: str | None = None
        self._beat_sha: str | None = None
        self._prefix: dict[tuple[str, str, Units], tuple[bytes, bytes]] = {}

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
        """All lease calls (and a heartbeat) in one pipelined round trip.

        `beat` is (policy sha256, ttl_us; 0 leaves). Returns the grants in call
        order and, with `beat`, the live engines as (id, policy sha256).
        Raises redis errors (the caller counts them).
        """
        from redis.exceptions import NoScriptError

        for attempt in (0, 1):
            if self._lease_sha is None:
                self.load()
            parts = [self._lease_call(engine_id, c, demand_ttl_us) for c in calls]
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
                self._prefix.clear()
                continue
            for r in replies:
                if isinstance(r, Exception):
                    raise r
            break
        grants = [Grant(*(int(x) for x in r)) for r in replies[: len(calls)]]
        engines = None
        if beat is not None:
            raw = replies[-1]
            engines = [(_s(raw[i]), _s(raw[i + 1])) for i in range(0, len(raw), 2)]
        return grants, engines

    def _lease_call(self, engine_id: str, c: LeaseCall, demand_ttl_us: int) -> bytes:
        """One EVALSHA in RESP, its constant head cached per user and limit:
        redis-py's pipeline spends ~40 us per command packing its arguments,
        which at 10,000 users is most of a round trip."""
        key = (engine_id, c.user, c.units)
        cached = self._prefix.get(key)
        if cached is None:
            if len(self._prefix) > 100_000:
                self._prefix.clear()
            tat, dem = user_keys(c.user)
            u = c.units
            sha = self._lease_sha or ""  # loaded by round_trip before any call
            cached = (
                b"*17\r\n" + b"".join(_bulk(x) for x in (b"EVALSHA", sha, 2, tat, dem, engine_id)),
                b"".join(_bulk(x) for x in (u.p, u.num, u.tol_us)),
            )
            self._prefix[key] = cached
        head, tail = cached
        return b"".join(
            (
                head,
                _bulk(c.demand),
                _bulk(c.credit),
                _bulk(c.want),
                _bulk(c.refund),
                tail,
                _bulk(c.horizon_us),
                _bulk(c.debt_us),
                _bulk(demand_ttl_us),
                b"$1\r\n1\r\n" if c.register else b"$1\r\n0\r\n",
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


def _bulk(x: bytes | str | int) -> bytes:
    b = x if isinstance(x, bytes) else str(x).encode()
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _pack(*args: bytes | str | int | None) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a if a is not None else b"") for a in args)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
