"""A Limiter lent by a SharedBudget, and its lease thread, against a real
redis-server: the same decisions as Limiter without a store, credit spent and
handed back, rounds capped with newcomers first and the others in turn, two
engines sharing one budget within the stated bound, and every fault: a store
unreachable at start, lost mid-run, back without a burst, slow."""

from __future__ import annotations

import logging
import threading
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("redis")

from redis_support import (  # noqa: E402
    PLAIN_PASSWORD,
    SECRET,
    STORE_USER,
    STORE_USER_PASSWORD,
    RedisServer,
    credential_urls,
)

from outrate.budget.limiter import Limiter  # noqa: E402
from outrate.budget.shared.credit import Mode, SharedBudget, credit_of  # noqa: E402
from outrate.budget.shared.lease import RedisLink, user_keys  # noqa: E402
from outrate.budget.shared.runner import TIMEOUT_S, LeaseRunner  # noqa: E402
from outrate.observe.metrics import Metrics  # noqa: E402
from outrate.observe.publish import SnapshotCollector, snapshot, write_snapshot  # noqa: E402
from outrate.observe.trace import engine_rate, max_window_excess  # noqa: E402
from outrate.policy.compiler import compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402

MS = 1_000_000
S = 1_000_000_000

POLICY = "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: 20\n  bob: 100\n"


def policy(text: str = POLICY, sha: str = "sha-a"):
    return compile_policy(parse_policy(text, "t.yaml"), "t.yaml", sha)


@pytest.fixture
def fresh(redis_server):
    redis_server.client().flushall()
    return redis_server


def engine(url, pol=None, name="e1", start=False, **kw):
    """A table lent by a shared budget, and its lease thread (`runner.budget`)."""
    pol = pol or policy()
    budget = SharedBudget(**{k: v for k, v in kw.items() if k in ("fallback", "engines_hint")})
    lim = Limiter(pol, lender=budget)
    runner = LeaseRunner(
        lim,
        budget,
        RedisLink(url),
        policy_sha=lambda: pol.sha256,
        engine=name,
        **{k: v for k, v in kw.items() if k in ("interval_s", "retry_s", "heartbeat_s", "cap")},
    )
    if start:
        runner.start()
    else:
        runner.connect()  # one synchronous attempt; rounds are driven by the test
    return lim, runner


def settle(lim: Limiter) -> None:
    """What the scheduler does between steps: apply a mode switch, release."""
    lim.cleanup(time.monotonic_ns(), 0)


def held(b) -> int:
    return credit_of(b).held


def record_calls(runner: LeaseRunner) -> list[list]:
    """The lease calls of every round trip from now on, round by round."""
    sent: list[list] = []
    stock = runner.link.round_trip

    def recorded(engine, calls, *a, **kw):
        sent.append(list(calls))
        return stock(engine, calls, *a, **kw)

    runner.link.round_trip = recorded
    return sent


# -- without a store: exactly the Limiter ------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "back", "ready", "avail"]), st.integers(0, 60 * MS)),
        max_size=80,
    ),
    st.sampled_from(["share", "full"]),
)
def test_without_a_store_the_decisions_are_the_limiters(ops, fallback):
    """Never connected and one engine: the lent table is Limiter, verb for verb."""
    pol = policy()
    a, b = Limiter(pol), Limiter(pol, lender=SharedBudget(fallback=fallback))
    ba, bb = a.pin("alice"), b.pin("alice")
    now = 10 * S
    taken = 0
    for op, gap in ops:
        now += gap
        if op == "take":
            r = a.take(ba, now)
            assert b.take(bb, now) == r
            taken += r
        elif op == "back" and taken:
            a.give_back(ba, now)
            b.give_back(bb, now)
            taken -= 1
        elif op == "ready":
            assert a.ready_at(ba, now) == b.ready_at(bb, now)
        else:
            assert a.available(ba, now) == b.available(bb, now)


def test_credit_is_spent_given_back_and_never_overdrawn():
    budget = SharedBudget()
    lim = Limiter(policy(), lender=budget)
    budget.mode = Mode(shared=True)  # (as the lease thread publishes it)
    settle(lim)
    b = lim.pin("alice")
    c = credit_of(b)
    now = 10 * S
    assert not lim.take(b, now)  # no credit yet
    assert lim.available(b, now) == 0 and lim.ready_at(b, now) > now
    c.granted += 2
    assert lim.available(b, now) == 2
    assert lim.take(b, now) and lim.take(b, now)
    assert not lim.take(b, now)  # the local burst has room; the credit has none
    lim.give_back(b, now)
    assert c.held == 1 and lim.take(b, now)
    c.granted += 2
    now += S  # the local burst is back: 3 tokens; the credit holds 2
    assert lim.take_upto(b, now, 10) == 2 and c.held == 0  # a bulk take stops at the credit
    lim.give_back(b, now, 2)
    assert c.held == 2 and lim.available(b, now) == 2
    bob = lim.pin("nobody")  # unlimited users never need credit
    assert all(lim.take(bob, now) for _ in range(100))
    lim.unpin(b)  # the user's last request left: its credit is handed back
    assert c.held == 0 and c.released == 2


def test_the_mode_is_applied_at_a_step_boundary_only():
    """The lease thread's record takes effect at the next pin or cleanup,
    never inside a step: a take between publishing and the boundary still
    decides in the mode it started the step in."""
    budget = SharedBudget(engines_hint=2)
    lim = Limiter(policy(), lender=budget)
    b = lim.pin("alice")
    now = 10 * S
    assert lim.limit_of(b, now).rate == 10  # the fallback: rate/2
    budget.mode = Mode(shared=True, n=2)
    assert lim.take(b, now)  # still local: no credit needed
    settle(lim)
    assert budget.applied == budget.mode and lim.limit_of(b, now).rate == 20
    assert not lim.take(b, now)  # shared now: no credit yet
    credit_of(b).share = Fraction(1, 4)  # as the lease thread writes a new share...
    budget.reshare.append(b)  # ...and hands the bucket over
    assert lim.limit_of(b, now).rate == 20
    settle(lim)
    assert lim.limit_of(b, now).rate == 5


# -- with a store ------------------------------------------------------------------


def test_credit_is_leased_and_handed_back(fresh):
    lim, runner = engine(fresh.url)
    assert runner.up and runner.budget.mode.shared
    settle(lim)
    assert runner.budget.applied.shared
    b = lim.pin("bob")
    c = credit_of(b)
    assert runner.round()
    assert c.held == 2 == c.fair  # 100 tok/s x 20 ms
    demand = fresh.client().get(user_keys("bob")[1])
    assert demand.startswith(b"1:") and demand.endswith(b":e1\n")
    now = time.monotonic_ns()
    assert lim.take(b, now) and lim.take(b, now) and not lim.take(b, now)
    lim.unpin(b)
    assert runner.round()  # demand 0: deregisters, nothing left to return
    assert fresh.client().exists(user_keys("bob")[1]) == 0
    # A user who leaves holding credit gets it back to Redis.
    b = lim.pin("bob")
    c = credit_of(b)
    runner.round()
    assert c.held == 2
    lim.unpin(b)
    assert c.released == 2
    tat_before = int(fresh.client().get(user_keys("bob")[0]))
    runner.round()
    assert c.sent == 2
    tat = fresh.client().get(user_keys("bob")[0])
    assert tat is None or int(tat) <= tat_before - 2 * 10_000
    runner.round()
    assert c not in runner.turns.active and not c.leased  # settled: cleanup may forget it
    assert lim.cleanup(time.monotonic_ns() + S, 8) == 1 and "bob" not in lim
    runner.stop()


def greedy(lim: Limiter, user: str, until: float, out: list, streams: int = 2) -> None:
    """A scheduler-like loop: every ~2 ms, take up to one token per stream."""
    b = lim.pin(user)
    while time.monotonic() < until:
        now = time.monotonic_ns()
        k = sum(lim.take(b, now) for _ in range(streams))
        if k:
            out.append((now, k))
        lim.cleanup(now, 4)
        time.sleep(0.002)
    lim.unpin(b)


def test_two_engines_share_one_budget_within_the_bound(fresh):
    """alice (20 tok/s) with two streams on each of two engines: the sum
    obeys (W + burst) * rate + 1 + slack, slack = rate * H + N with H the
    20 ms interval (a little under S, whose H adds a round trip: stricter),
    and each engine gets a fair part."""
    engines = [engine(fresh.url, name=f"e{i}", start=True) for i in range(2)]
    until = time.monotonic() + 3.0
    outs: list[list] = [[], []]
    threads = [
        threading.Thread(target=greedy, args=(lim, "alice", until, outs[i]))
        for i, (lim, _) in enumerate(engines)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, runner in engines:
        runner.stop()
    merged = sorted(outs[0] + outs[1])
    total = sum(k for _, k in merged)
    span = (merged[-1][0] - merged[0][0]) / S
    slack = 20 * 0.02 + 2
    excess = max_window_excess(merged, 20, 100 * MS)
    print(f"tokens {[sum(k for _, k in o) for o in outs]} in {span:.2f} s, excess {excess:.2f}")
    assert excess <= slack
    assert (total - 1) / span >= 0.9 * 20
    assert min(sum(k for _, k in o) for o in outs) >= 0.35 * total


def test_slow_rounds_keep_the_users_rate(fresh):
    """Round trips of ~250 ms (2.5 bursts): the slice is rate x H with H the
    measured period plus a round trip, and a call grants what conforms
    within H, so bob
    (100 tok/s, burst 100 ms) keeps his rate; the overshoot stays within
    S = rate * (H + max(0, H - burst)) + N. Before the horizon reach a call
    granted only what conformed at once (11 tokens per round: ~40 tok/s)."""
    lim, runner = engine(fresh.url)
    stock = runner.link.round_trip

    def slow(*a, **kw):
        time.sleep(0.25)  # a slow store (or a long round): the GIL is released
        return stock(*a, **kw)

    runner.link.round_trip = slow
    runner.start()
    settle(lim)
    out: list = []
    greedy(lim, "bob", time.monotonic() + 3.0, out, 4)
    runner.stop()
    h = runner.max_horizon_us / 1e6
    slack = 100 * (h + max(0.0, h - 0.1)) + 1
    excess = max_window_excess(out, 100, 100 * MS)
    late = [x for x in out if x[0] >= out[0][0] + S]  # after the first slow rounds
    rate = engine_rate(late)
    print(f"H {h * 1000:.0f} ms: {rate:.1f} tok/s after 1 s, excess {excess:+.2f} (S {slack:.1f})")
    assert h > 0.4  # back-to-back rounds: H is two of them
    assert excess <= slack
    assert rate >= 0.85 * 100


def test_rounds_are_capped_newcomers_first_then_in_turn(fresh):
    """The stated cap: a round sends at most `cap` calls, newcomers first,
    then the others in turn from where the last round stopped. 250 new users
    and a cap of 100: rounds of 100, 100 and 50 calls (after its first slice
    a user holds credit and needs no call), each user called exactly once;
    a user who arrives later goes first, ahead of those whose turn it is."""
    pol = policy("version: 1\ndefault: 100\nburst: 100ms\n")
    lim, runner = engine(fresh.url, pol, cap=100)
    settle(lim)
    sent = record_calls(runner)
    buckets = [lim.pin(f"u{i}") for i in range(250)]
    for _ in range(3):
        assert runner.round()
    users = [[c.user for c in calls] for calls in sent]
    assert [len(u) for u in users] == [100, 100, 50]
    assert sorted(sum(users, [])) == sorted(b.key for b in buckets)  # each once
    assert users[0] == [f"u{i}" for i in range(100)]  # in arrival order
    assert all(held(b) > 0 for b in buckets)
    # The third round visited the last 50 newcomers, then (without calls)
    # everyone else in turn. Now each spends its credit, so each is low: a
    # newcomer first, then the others in turn from there, 100 calls a round.
    for b in buckets:
        lim.take_upto(b, time.monotonic_ns(), 1000)
    late = lim.pin("late")
    assert runner.round() and runner.round()
    assert [c.user for c in sent[-2]] == ["late"] + [
        f"u{i}" for i in [*range(200, 250), *range(49)]
    ]
    assert [c.user for c in sent[-1]] == [f"u{i}" for i in range(49, 149)]
    lim.unpin(late)
    runner.stop()


def test_with_more_users_than_the_cap_each_keeps_its_rate(fresh):
    """300 users at 100 tok/s and rounds of at most 100 calls: a user is
    called every 3 rounds or sooner, and its slice lasts until then (the
    horizon is 3 periods plus a round trip), so every user keeps its rate
    while the lease thread keeps to one round trip per interval."""
    pol = policy("version: 1\ndefault: 100\nburst: 100ms\n")
    lim, runner = engine(fresh.url, pol, cap=100)
    sent = record_calls(runner)
    buckets = [lim.pin(f"u{i}") for i in range(300)]
    runner.start()
    got = [0] * len(buckets)
    t0 = time.monotonic_ns()
    warm, end = t0 + S // 2, t0 + 4 * S  # 3.5 s counted: one stall of the VM is not the rate
    late0 = 0
    while (now := time.monotonic_ns()) < end:  # the scheduler: every 10 ms, all it may
        if now >= warm and not late0:
            late0, rounds0 = runner.late_ns + 1, len(sent)
        for i, b in enumerate(buckets):
            k = lim.take_upto(b, now, 1000)
            if now >= warm:
                got[i] += k
        lim.cleanup(now, 4)
        time.sleep(0.01)
    rounds = sent[:]
    runner.stop()
    span = (end - warm) / S
    late = (runner.late_ns - late0 + 1) / S
    rates = sorted(g / span for g in got)
    print(
        f"300 users: {(len(rounds) - rounds0) / span:.1f} round trips/s, at most "
        f"{max(len(c) for c in rounds)} calls, H up to {runner.max_horizon_us / 1000:.0f} ms, "
        f"tok/s per user min {rates[0]:.1f} median {rates[150]:.1f}, late {late * 1000:.0f} ms"
    )
    assert max(len(calls) for calls in rounds) <= 100
    assert runner.max_horizon_us >= 3 * runner.interval_ns // 1000
    floor = 100 * max(0.0, span - late) / span
    assert rates[150] >= 0.9 * floor
    assert rates[0] >= 0.75 * floor  # every user gets its turns


def test_unreachable_at_start_limited_users_wait_then_shared_when_it_answers(tmp_path, caplog):
    """An engine that never reached its store knows neither N nor its share:
    it starts, its limited users wait (nothing cut, unlimited users run), and
    it shares as soon as the store answers."""
    server = RedisServer(tmp_path)  # not started: nothing listens on its port
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    lim, runner = engine(server.url, engines_hint=2, start=True, retry_s=0.1)
    try:
        assert runner.up is False and runner.metrics.up == 0 and runner.metrics.waiting == 1
        assert "unreachable at start" in caplog.text and "limited users wait" in caplog.text
        b = lim.pin("alice")
        now = 10 * S
        assert sum(lim.take(b, now) for _ in range(10)) == 0  # waits for the store
        free = lim.pin("nobody")
        assert all(lim.take(free, now) for _ in range(10))  # unlimited: untouched
        server.start()
        # The lease thread sets `up` before its first round and logs after it:
        # wait for the log line, the last thing it does.
        deadline = time.monotonic() + 5
        while "sharing budgets through" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "sharing budgets through" in caplog.text
        assert runner.up and runner.metrics.up == 1 and runner.metrics.waiting == 0
        settle(lim)
        # Shared now, but within rate/2 until the heartbeats show the other
        # engine (it may still be in its fallback) or the grace ends.
        assert runner.budget.applied == Mode(shared=True, grace=True, n=2)
        assert lim.limit_of(b, now).rate == 10
    finally:
        runner.stop()
        server.stop()
    assert server.password is None  # (the URL carried none to leak)


def test_unreachable_at_start_with_fallback_full_serves_the_full_rate(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    lim, runner = engine(RedisServer(tmp_path).url, engines_hint=2, fallback="full")
    assert runner.up is False and runner.metrics.waiting == 0
    assert "enforcing the full rate" in caplog.text
    settle(lim)
    b = lim.pin("alice")
    assert lim.limit_of(b, 10 * S).rate == 20
    assert sum(lim.take(b, 10 * S) for _ in range(10)) == 3  # 1 + 100 ms x 20 tok/s
    runner.stop()


def test_a_store_that_refuses_the_engine_stops_its_start(tmp_path, caplog):
    """A wrong password is not an outage: waiting does not mend it, and an
    engine that never joined must not guess its share. The start fails and
    says why, without the password; with the fallback `full` (the
    operator's choice) it starts at the full rate."""
    from outrate.budget.shared.runner import StoreRefused

    caplog.set_level(logging.INFO, logger="vllm.outrate")
    server = RedisServer(tmp_path, password=PLAIN_PASSWORD).start()
    wrong = f"redis://:{SECRET}-wrong@127.0.0.1:{server.port}/0"
    try:
        with pytest.raises(StoreRefused, match="refused this engine at start") as exc:
            engine(wrong, start=True)
        assert "AuthenticationError" in str(exc.value) and SECRET not in str(exc.value)
        lim, runner = engine(wrong, fallback="full", start=True)
        assert runner.up is False and runner.metrics.errors >= 1
        settle(lim)
        assert lim.limit_of(lim.pin("alice"), 10 * S).rate == 20
        runner.stop()
        # A cluster node behind a plain URL answers MOVED: refused too.
    finally:
        server.stop()
    assert SECRET not in caplog.text


def test_lost_mid_run_falls_back_then_resumes_without_a_burst(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    server = RedisServer(tmp_path).start()
    a, ra = engine(server.url, name="a", heartbeat_s=0)  # a heartbeat every round
    b_lim, rb = engine(server.url, name="b", heartbeat_s=0)
    try:
        ra.round()  # a heartbeat: two live engines
        assert ra.engines == 2
        settle(a)
        bucket = a.pin("alice")
        ra.round()
        assert held(bucket) >= 1
        server.stop()
        assert not ra.round()  # one failure is retried at the next round
        assert ra.up and ra.metrics.errors == 1 and "lost" not in caplog.text
        assert not ra.round()  # the second in a row: fallback
        assert ra.metrics.up == 0 and ra.metrics.errors == 2
        assert ra.metrics.transitions["down"] == 1
        assert "lost" in caplog.text and "rate/2" in caplog.text
        settle(a)
        assert ra.budget.applied == Mode(shared=False, n=2)
        assert held(bucket) == 0  # pre-outage credit dropped
        caplog.clear()
        ra.round()  # further failures are counted, not logged again
        assert ra.metrics.errors == 3 and "lost" not in caplog.text
        time.sleep(0.3)  # the outage lasts 0.3 s past the last round
        now = time.monotonic_ns()
        assert a.limit_of(bucket, now).rate == 10
        assert sum(a.take(bucket, now) for _ in range(10)) == 2  # local, rate/2
        server.start()  # an empty Redis: every TAT forgotten
        horizons = []
        stock = ra.link.round_trip

        def seen(engine, calls, *a, **kw):
            horizons.extend(c.horizon_us for c in calls if c.demand)
            return stock(engine, calls, *a, **kw)

        ra.link.round_trip = seen
        ra.connect()
        # The outage was no round period: the first round back leases for
        # one interval (20 ms), not for the outage (~0.3 s here, up to 1 s).
        assert horizons == [20_000]
        assert ra.up and ra.metrics.transitions["up"] == 1 and "is back" in caplog.text
        # The debt spent during the outage was carried over: no burst now.
        settle(a)
        assert ra.budget.applied == Mode(shared=True, grace=True, n=2)  # b may still be in
        # its fallback: stay at rate/2
        assert a.limit_of(bucket, time.monotonic_ns()).rate == 10
        for r in (rb, ra):  # b is back too: the heartbeats show both
            r.round()
        settle(a)
        assert not ra.budget.applied.grace and a.limit_of(bucket, time.monotonic_ns()).rate == 20
        tat = int(server.client().get(user_keys("alice")[0]))
        now_us = server.client().time()
        now_us = now_us[0] * 1_000_000 + now_us[1]
        assert tat - now_us >= 100_000 - 20_000  # the burst is spent
        assert held(bucket) <= 1
    finally:
        ra.stop()
        rb.stop()
        server.stop()


@pytest.mark.parametrize("form", list(credential_urls(0)))
def test_no_log_line_or_metric_shows_the_store_credentials(tmp_path, caplog, form):
    """Every line the lease thread logs with the store's URL (unreachable at
    start, sharing, lost, back) and the /metrics page it feeds, for each way
    a URL can carry a password and a user."""
    from prometheus_client import CollectorRegistry, generate_latest

    caplog.set_level(logging.INFO, logger="vllm.outrate")
    server = RedisServer(tmp_path, password=PLAIN_PASSWORD, users={STORE_USER: STORE_USER_PASSWORD})
    pol = policy()
    lim, runner = engine(credential_urls(server.port)[form], pol, engines_hint=2, heartbeat_s=0)
    try:
        server.start()
        runner.connect()
        lim.pin("alice")
        assert runner.round() and runner.up
        server.stop()
        assert not runner.round() and not runner.round()  # lost (each round beats)
        server.start()
        runner.connect()
        assert runner.up
        # /metrics as the API server renders it, from the engine's snapshot.
        data = snapshot(Metrics(), pol, store=runner.metrics.snapshot())
        write_snapshot(str(tmp_path / "engine-metrics.json"), data)
        registry = CollectorRegistry()
        registry.register(SnapshotCollector(str(tmp_path)))
        page = generate_latest(registry).decode()
    finally:
        runner.stop()
        server.stop()
    lines = [
        r.getMessage() for r in caplog.records if f"127.0.0.1:{server.port}/0" in r.getMessage()
    ]
    said = " | ".join(lines)
    for line in ("unreachable at start", "sharing budgets through", " lost ", "is back"):
        assert line in said
    assert SECRET not in caplog.text and STORE_USER not in caplog.text
    assert "outrate_store_up 1.0" in page and "outrate_store_transitions_total" in page
    assert SECRET not in page and STORE_USER not in page


def test_a_slow_store_never_blocks_the_scheduler(tmp_path):
    """Redis frozen (SIGSTOP): the lease thread's round trip hangs until its
    timeout; the scheduler's takes keep running meanwhile, and the engine
    falls back."""
    server = RedisServer(tmp_path).start()
    lim, runner = engine(server.url, start=True)
    try:
        b = lim.pin("bob")
        time.sleep(0.1)
        server.pause()
        calls, slowest = 0, 0
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            t0 = time.perf_counter_ns()
            lim.take(b, time.monotonic_ns())
            lim.cleanup(time.monotonic_ns(), 4)
            slowest = max(slowest, time.perf_counter_ns() - t0)
            calls += 1
        assert runner.up is False and runner.metrics.errors >= 1
        print(f"{calls} takes while Redis was frozen, slowest {slowest / 1e3:.0f} us")
        # A take that waited on the store (a lock held across the round trip,
        # say) would wait out its timeout: a few calls, each >= 500 ms. The
        # slowest one is only reported beside it: a loaded 2-core machine stalled
        # a thread for 148 ms once (load 4.6), with no store involved.
        assert calls > 1000
        assert slowest < TIMEOUT_S * 1e9
    finally:
        server.resume()
        runner.stop()
        server.stop()


def test_engines_with_another_policy_are_reported(fresh, caplog):
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    a, ra = engine(fresh.url, policy(sha="sha-one"), name="a", heartbeat_s=0)
    b, rb = engine(fresh.url, policy(sha="sha-two"), name="b")
    ra.round()
    assert ra.metrics.policy_mismatch == 1 and ra.metrics.engines == 2
    assert "another policy" in caplog.text and "b (sha-two" in caplog.text
    caplog.clear()
    ra.round()
    assert "another policy" not in caplog.text  # logged once per change
    ra.stop()
    rb.stop()


def test_a_returning_user_gets_credit_within_one_lease_interval(fresh):
    """A new user's arrival wakes the lease thread: its first credit comes
    after one round trip, not at the next tick. Each user arrives 0.6 s into
    a 1 s interval, so waiting for the tick would take 0.4 s; the wake takes a
    round trip (milliseconds; a loaded machine can stall a thread ~150 ms)."""
    lim, runner = engine(fresh.url, interval_s=1.0, heartbeat_s=0)  # every round calls
    starts: list[int] = []
    stock = runner.link.round_trip

    def timed(*a, **kw):
        starts.append(time.monotonic_ns())
        return stock(*a, **kw)

    runner.link.round_trip = timed
    runner.start()
    settle(lim)
    waits = []
    try:
        for i in range(4):
            while time.monotonic_ns() < starts[-1] + 600 * MS:
                time.sleep(0.002)
            t0 = time.monotonic()
            b = lim.pin("alice" if i % 2 else "bob")
            while held(b) <= 0 and time.monotonic() - t0 < 2:
                time.sleep(0.0005)
            waits.append(time.monotonic() - t0)
            lim.unpin(b)
            settle(lim)
    finally:
        runner.stop()
    print("first credit after", [f"{w * 1000:.1f} ms" for w in waits])
    assert max(waits) < 0.3


def test_store_metrics_reach_prometheus_families():
    from outrate.budget.shared.metrics import StoreMetrics
    from outrate.observe.metrics import Metrics
    from outrate.observe.publish import families, snapshot

    store = StoreMetrics()
    store.up, store.errors, store.engines = 1, 3, 2
    store.transitions["down"] = 1
    store.lease.observe(700_000)  # 0.7 ms
    fams = {f.name: f for f in families(snapshot(Metrics(), policy(), store=store.snapshot()))}
    for name in (
        "outrate_store_up",
        "outrate_store_errors",
        "outrate_store_transitions",
        "outrate_lease_seconds",
        "outrate_store_engines",
        "outrate_store_policy_mismatch",
    ):
        assert name in fams
    assert fams["outrate_store_errors"].samples[0].value == 3
    lease = {s.labels.get("le"): s.value for s in fams["outrate_lease_seconds"].samples}
    assert lease["0.0005"] == 0 and lease["0.001"] == 1
    assert "outrate_store_up" not in {f.name for f in families(snapshot(Metrics(), policy()))}


def test_data_parallel_engines_write_their_own_files_and_metrics_merge(tmp_path):
    """With --data-parallel-size N each engine core writes its own trace and
    metrics snapshot (`.dp<rank>`); /metrics shows their sum."""
    from outrate.budget.shared.metrics import StoreMetrics
    from outrate.observe.metrics import Metrics
    from outrate.observe.publish import read_snapshot, snapshot, write_snapshot

    pol = policy()
    snaps = []
    for rank in range(2):
        m, store = Metrics(), StoreMetrics()
        store.up, store.engines, store.errors = rank, 2, 1  # rank 0 sees no store
        m.record("alice").tokens = 10 + rank
        m.record("alice").interval.observe(5 * MS)
        snaps.append(snapshot(m, pol, store=store.snapshot()))
        write_snapshot(str(tmp_path / f"engine-metrics.dp{rank}.json"), snaps[-1])
    merged = read_snapshot(str(tmp_path))
    assert merged is not None
    assert merged["labels"]["alice"]["tokens"] == 21
    assert sum(merged["labels"]["alice"]["interval"][0]) == 2
    assert merged["store"]["up"] == 0 and merged["store"]["errors"] == 2
    assert merged["store"]["engines"] == 2
    pytest.importorskip("vllm")
    from vllm_integration.common.settings import EngineSettings, dp_suffix, rank_path

    class PC:
        data_parallel_size = 2
        data_parallel_index = 1

    class VC:
        parallel_config = PC()

    assert dp_suffix(VC()) == ".dp1" and dp_suffix(None) == ""
    PC.data_parallel_size = 1  # what vLLM leaves in a non-MoE data-parallel engine core
    assert dp_suffix(VC()) == ""
    assert dp_suffix(VC(), EngineSettings(data_parallel_size=2)) == ".dp1"
    assert rank_path("/x/trace.jsonl", ".dp1") == "/x/trace.dp1.jsonl"
