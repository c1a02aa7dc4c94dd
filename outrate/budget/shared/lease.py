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
- `outrate:{g:<n>}:pt:<user>` and `outrate:{g:<n>}:pd:<user>`: the same two
  for the user's prompt budget (`prompt:` limits; the kind `PROMPT`), its
  own GCRA under the same group, so one script call serves both kinds.

Both keys carry a TTL: a user who leaves leaves nothing behind. One more
key per group lives a day past its last call, `outrate:{g:<n>}:epoch`: made once, it tells an
engine that the group's state was lost under it (FLUSHALL, a restart
without persistence), and the script then assumes the worst of every TAT
it lost (outrate.budget.shared.scripts).

And one hash per deployment, `outrate:{engines}` (the API servers' that
lease request rates: `outrate:{engines}:api`): each engine's heartbeat
(its expiry, its policy's sha256, how long the others keep its part when
it goes missing, and its N), plus `outrate:{engines}:<id>`, a key
with a TTL per engine for people looking with redis-cli.

Nothing here runs on the scheduler's thread; redis is imported lazily.
"""

from __future__ import annotations

import binascii
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from outrate.budget.shared.nodes import Part, sha1
from outrate.budget.shared.scripts import HEARTBEAT_SCRIPT, LEASE_SCRIPT
from outrate.budget.shared.topology import open_nodes
from outrate.budget.shared.url import PASSWORD_ENV as PASSWORD_ENV  # (re-exported)
from outrate.budget.shared.url import check_url as check_url
from outrate.budget.shared.url import redact_url as redact_url
from outrate.budget.shared.url import split_password as split_password
from outrate.budget.shared.url import split_ssl_password
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


OUTPUT = ""
"""The kind of budget a lease call is for: output tokens (keys `t:`, `d:`)."""
PROMPT = "p"
"""Prompt tokens (keys `pt:`, `pd:`): a prompt limit's own global GCRA."""
REQUESTS = "r"
"""Requests (keys `rt:`, `rd:`): a request rate's global GCRA, leased by
the API servers (outrate.contract.requests)."""
API_SERVERS_KEY = f"{ENGINES_KEY}:api"
"""The API servers' heartbeats: apart from the engines' (an API server is
not an engine: it must not change what an engine's fallback divides by),
under the same hash tag (one slot)."""


def user_keys(user: str, kind: str = OUTPUT) -> tuple[str, str]:
    """(tat key, demand key) of one user's budget of `kind`, under its
    group's hash tag (the user's, whatever the kind). The id follows the
    tag, so no character of it can change the slot."""
    base = f"{PREFIX}:{{g:{group_of(user)}}}"
    return f"{base}:{kind}t:{user}", f"{base}:{kind}d:{user}"


def engine_key(engine_id: str) -> str:
    return f"{ENGINES_KEY}:{engine_id}"


def epoch_key(group: int) -> str:
    """The group's epoch (a day's TTL, renewed): gone or changed means its state was lost."""
    return f"{PREFIX}:{{g:{group}}}:epoch"


def _slot(key: str) -> int:
    """Redis Cluster's hash slot of `key`: CRC16/XMODEM of its hash tag, mod
    16384 (here without importing redis)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key.encode(), 0) % 16384


GROUP_SLOTS = [_slot(epoch_key(g)) for g in range(GROUPS)]
"""The cluster hash slot of each group's keys (their hash tag's)."""
ENGINES_SLOT = _slot(ENGINES_KEY)
SLOTS = (*GROUP_SLOTS, ENGINES_SLOT)
"""Every slot an engine's keys are in."""
LEASE_SHA = sha1(LEASE_SCRIPT)
BEAT_SHA = sha1(HEARTBEAT_SCRIPT)


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
    lost: bool = False
    """This user's state was lost in Redis (its group's epoch changed): the
    script puts its TAT where the lost one may have been, at the worst."""
    kind: str = OUTPUT
    """Which of the user's budgets: `OUTPUT` or `PROMPT` (its keys)."""


class Round:
    """What a round trip got, filled in even when it raises (`into`): the
    grants of the calls whose script call answered (None for the others),
    the live engines, those missing, and the groups found reset."""

    def __init__(self) -> None:
        self.grants: list[Grant | None] = []
        self.engines: list[tuple[str, str, int]] | None = None
        """Live engines: (id, policy sha256, how long the others keep its part, us)."""
        self.missing: list[tuple[str, int]] = []
        """Engines whose heartbeat stopped without leaving: (id, their n)."""
        self.resets: set[int] = set()
        """Groups whose epoch changed since this engine last called them."""


class RedisLink:
    """One engine's connection to its store, used only by its lease thread:
    the packing of every round, over the nodes of the store's URL form
    (outrate.budget.shared.nodes: one server, Sentinel, or a cluster).

    Timeouts are short and the client never retries on its own: a failed
    round trip is retried by the next lease round, and an engine whose store
    does not answer within `timeout_s` enforces its fallback instead.
    """

    def __init__(
        self,
        url: str,
        password: str | None = None,
        timeout_s: float = 0.5,
        peers_key: str = ENGINES_KEY,
    ) -> None:
        check_url(url)
        self.peers_key = peers_key
        """Where this process heartbeats: the engines' hash, or the API servers'."""
        bare, in_url = split_password(url)  # the URL's password first, as redis-py would
        bare, ssl_in_url = split_ssl_password(bare)
        env = Env.read()
        password = in_url or password or env.store_password or None
        ssl_password = ssl_in_url or env.store_ssl_password or None
        self.url = redact_url(url)
        self.nodes = open_nodes(
            bare, password, timeout_s, (LEASE_SCRIPT, HEARTBEAT_SCRIPT), SLOTS, ssl_password
        )
        self._users: dict[tuple[str, str, Units], tuple[bytes, bytes]] = {}
        """Per kind, user and limit: its two keys and its limit, packed."""
        self.epochs: dict[int, bytes] = {}
        """Per group, the epoch this engine last saw (outrate.budget.shared.scripts)."""
        self.script_calls = 0
        """Lease script calls sent (a round's users, batched by group)."""

    @property
    def client(self) -> Any:
        """The redis-py client of a single server or Sentinel primary (benchmarks)."""
        return getattr(self.nodes, "client", None)

    def ping(self) -> None:
        """Reach the store (and learn its topology): raises if it does not answer."""
        self.nodes.connect()

    def round_trip(
        self,
        engine_id: str,
        calls: Sequence[LeaseCall],
        demand_ttl_us: int,
        beat: tuple[str, int] | None = None,
        into: Round | None = None,
        hold: tuple[int, int] = (0, 1),
    ) -> tuple[list[Grant], list[tuple[str, str, int]] | None]:
        """All lease calls (and a heartbeat) in one pipelined round trip per
        node: one script call per group of users (`batches`).

        `beat` is (policy sha256, ttl_us; 0 leaves); `hold` (keep_us, n): how
        long the others keep this engine's part once its heartbeat stops (and
        how long an engine that does not say its own is reported missing), and
        the live engines this one counts. Returns the grants in call order
        and, with `beat`, the live engines as (id, policy sha256, keep_us).
        Raises the first
        error (the caller counts it), after filling `into` with what did
        answer: on a cluster one shard may fail while the others grant.
        """
        got = into if into is not None else Round()
        groups = batches(calls)
        parts = [self._lease_call(engine_id, calls, g, demand_ttl_us) for g in groups]
        if beat is not None:
            sha, ttl_us = beat
            parts.append(
                Part(
                    ENGINES_SLOT,
                    _pack(
                        b"EVALSHA",
                        BEAT_SHA,
                        2,
                        self.peers_key,
                        f"{self.peers_key}:{engine_id}",
                        engine_id,
                        sha,
                        ttl_us,
                        *hold,
                    ),
                )
            )
        replies = self.nodes.send(parts)
        self.script_calls += len(groups)
        got.grants = [None] * len(calls)
        error: Exception | None = None
        for g, r in zip(groups, replies[: len(groups)], strict=True):
            if isinstance(r, Exception):
                if type(r).__name__ == "TryAgainError":
                    # A slot migrating with this call's keys on both sides:
                    # its users are called again next round (not an outage).
                    self.nodes.redirects["tryagain"] = self.nodes.redirects.get("tryagain", 0) + 1
                else:
                    error = error or r
                continue
            *v, now, epoch, reset = r.split()
            group = group_of(calls[g[0]].user)
            if reset == b"1":
                got.resets.add(group)
            self.epochs[group] = epoch
            now_us = int(now)
            for j, i in enumerate(g):
                k = 4 * j
                got.grants[i] = Grant(
                    int(v[k]), int(v[k + 1]), int(v[k + 2]), int(v[k + 3]), now_us
                )
        if beat is not None:
            raw = replies[-1]
            if isinstance(raw, Exception):
                error = error or raw
            else:
                live, missing = raw
                got.engines = [
                    (_s(live[i]), _s(live[i + 1]), int(live[i + 2])) for i in range(0, len(live), 3)
                ]
                got.missing = [
                    (_s(missing[i]), int(missing[i + 1])) for i in range(0, len(missing), 2)
                ]
        if error is not None:
            raise error
        return got.grants, got.engines  # type: ignore[return-value]  # every index answered

    def _lease_call(
        self, engine_id: str, calls: Sequence[LeaseCall], batch: list[int], demand_ttl_us: int
    ) -> Part:
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
            cached = users.get((c.kind, c.user, c.units))
            if cached is None:
                if len(users) > 100_000:
                    users.clear()
                tat, dem = user_keys(c.user, c.kind)
                u = c.units
                cached = (_bulk(tat) + _bulk(dem), b"%d %d %d" % (u.p, u.num, u.tol_us))
                users[(c.kind, c.user, c.units)] = cached
            keys.append(cached[0])
            one = b"%d %d %d %d %s %d %d %d" % (
                c.demand,
                c.credit,
                c.want,
                c.refund,
                cached[1],
                c.horizon_us,
                c.debt_us,
                c.register + 2 * c.lost,
            )
            args.append(b"$%d\r\n%s\r\n" % (len(one), one))
        n = len(batch)
        group = group_of(calls[batch[0]].user)
        return Part(
            GROUP_SLOTS[group],
            b"".join(
                (
                    b"*%d\r\n" % (7 + 3 * n),
                    _bulk(b"EVALSHA"),
                    _bulk(LEASE_SHA),
                    _bulk(1 + 2 * n),
                    _bulk(epoch_key(group)),
                    *keys,
                    _bulk(engine_id),
                    _bulk(demand_ttl_us),
                    _bulk(self.epochs.get(group, b"-")),
                    *args,
                )
            ),
        )

    def close(self) -> None:
        try:
            self.nodes.close()
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
