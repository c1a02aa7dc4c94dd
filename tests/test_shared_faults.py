"""A Limiter lent by a SharedBudget, and its lease thread, through the faults
of a real redis-server: unreachable at start (local: rate/N with N from
--outrate-store-engines or the data-parallel size; pause: limited users
wait; full), a store that refuses the engine, lost mid-run and back without
a burst, an outage longer than the hold (local keeps serving, pause waits),
a frozen store, and no credential in any log line or metric."""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("redis")

from redis_support import (  # noqa: E402
    PLAIN_PASSWORD,
    SECRET,
    STORE_USER,
    STORE_USER_PASSWORD,
    RedisServer,
    credential_urls,
)
from shared_support import S, engine, held, policy, settle  # noqa: E402

from outrate.budget.shared.credit import Mode  # noqa: E402
from outrate.budget.shared.lease import user_keys  # noqa: E402
from outrate.budget.shared.runner import TIMEOUT_S  # noqa: E402
from outrate.observe.metrics import Metrics  # noqa: E402
from outrate.observe.publish import SnapshotCollector, snapshot, write_snapshot  # noqa: E402

pytestmark = pytest.mark.waits  # make test's waits lane (tests/lanes.py)


def test_unreachable_at_start_serves_rate_over_n_then_joins(tmp_path, caplog):
    """The default fallback (local): an engine that never reached its store
    starts, serves its limited users at rate/N with N the engines expected
    (here from the data-parallel size, and the warning says so), and shares
    as soon as the store answers, within rate/N until the heartbeats show
    the others back."""
    server = RedisServer(tmp_path)  # not started: nothing listens on its port
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    where = "N = 2 from --data-parallel-size (no --outrate-store-engines)"
    lim, runner = engine(server.url, engines_hint=2, expected_from=where, start=True, retry_s=0.1)
    try:
        assert runner.up is False and runner.metrics.up == 0 and runner.metrics.waiting == 0
        assert "unreachable at start" in caplog.text
        assert f"enforcing rate/2 on this engine until it answers ({where})" in caplog.text
        settle(lim)
        b = lim.pin("alice")
        now = 10 * S
        assert lim.limit_of(b, now).rate == 10
        assert sum(lim.take(b, now) for _ in range(10)) == 2  # 1 + 100 ms x 10 tok/s
        # A second of a scheduler taking all it may every 10 ms: 10 tokens more.
        later = sum(lim.take(b, now + t * S // 100) for t in range(1, 101) for _ in range(5))
        assert later == 10
        assert runner.metrics.fallback_s() > 0
        server.start()
        deadline = time.monotonic() + 5
        while "sharing budgets through" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "sharing budgets through" in caplog.text and "after all" in caplog.text
        assert runner.up and runner.metrics.fallback_s() == 0
        settle(lim)
        assert runner.budget.applied == Mode(shared=True, grace=True, n=2)
        assert lim.limit_of(b, time.monotonic_ns()).rate == 10
    finally:
        runner.stop()
        server.stop()


def test_unreachable_at_start_with_pause_limited_users_wait_then_shared(tmp_path, caplog):
    """The fallback pause: an engine that never reached its store does not
    know its share, so its limited users wait (nothing cut, unlimited users
    run), and it shares as soon as the store answers."""
    server = RedisServer(tmp_path)  # not started: nothing listens on its port
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    lim, runner = engine(server.url, engines_hint=2, fallback="pause", start=True, retry_s=0.1)
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
        sent_us = []  # Redis's clock (the machine's wall clock) as a leasing round left
        stock = ra.link.round_trip

        def seen(engine, calls, *a, **kw):
            horizons.extend(c.horizon_us for c in calls if c.demand)
            if any(c.demand for c in calls):
                sent_us.append(time.time_ns() // 1000)
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
        # The burst is spent: the TAT the first round back wrote is a burst,
        # less one lease interval, ahead of when that round left (against
        # the time it is read, a loaded machine failed it: 31.7 ms ahead,
        # read ~50 ms after the round).
        tat = int(server.client().get(user_keys("alice")[0]))
        assert tat - sent_us[0] >= 100_000 - 20_000, (tat, sent_us)
        assert held(bucket) <= 1
    finally:
        ra.stop()
        rb.stop()
        server.stop()


@pytest.mark.parametrize("fallback", ["local", "pause"])
def test_an_outage_longer_than_the_hold(tmp_path, caplog, fallback):
    """Two engines lose their store for 1.5 s with a hold of 0.5 s. With
    local (the default) each keeps serving alice at rate/2 for the whole
    outage (`outrate_store_fallback_seconds` grows past the hold: the alert's
    signal); with pause its limited users wait once the hold is over."""
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    server = RedisServer(tmp_path).start()
    kw = dict(fallback=fallback, heartbeat_s=0, retry_s=0.1, hold_s=0.5)
    a, ra = engine(server.url, name="a", **kw)
    b, rb = engine(server.url, name="b", **kw)
    try:
        ra.round()
        assert ra.engines == 2
        ra.start()
        bucket = a.pin("alice")
        time.sleep(0.1)
        server.stop()
        time.sleep(0.3)  # two failed rounds (~40 ms): the fallback
        settle(a)  # (a step boundary: the credit leased before is dropped)
        time.sleep(1.2)  # past the hold
        m = ra.metrics
        # On a loaded machine the failed rounds come later than ~40 ms: give
        # the switch at the hold's end up to 5 s more to show.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            settle(a)
            if (m.fallback_s() > m.hold_s) if fallback == "local" else m.waiting:
                break
            time.sleep(0.05)
        now = time.monotonic_ns()
        if fallback == "local":
            assert ra.budget.applied == Mode(shared=False, n=2) and m.waiting == 0
            assert m.fallback_s() > m.hold_s == 0.5
            assert a.limit_of(bucket, now).rate == 10
            assert sum(a.take(bucket, now) for _ in range(10)) >= 1  # served, at rate/2
            assert "until it answers" in caplog.text and "still lost" not in caplog.text
        else:
            assert m.waiting == 1 and m.fallback_s() == 0
            assert sum(a.take(bucket, now) for _ in range(10)) == 0  # waits for the store
            assert "still lost after 0.5 s" in caplog.text
            # both of pause's lines say what it leaves running (issue 42)
            borrow = "users with a peak still borrow up to peak - rate on this engine"
            assert f"then limited users wait for it ({borrow}" in caplog.text
            assert f"this engine's part); {borrow}" in caplog.text
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
        # Take for 1.5 s, and on until the lease thread has seen the store
        # stop answering: its next round trip starts when bob's slice runs
        # low (rate x H, and H grows to 1 s on a starved machine) or at the
        # heartbeat, then waits out its timeout.
        calls, slowest = 0, 0
        t0_s = time.monotonic()
        t_min, t_max = t0_s + 1.5, t0_s + 10
        while (now_s := time.monotonic()) < t_min or (runner.up is not False and now_s < t_max):
            t0 = time.perf_counter_ns()
            lim.take(b, time.monotonic_ns())
            lim.cleanup(time.monotonic_ns(), 4)
            slowest = max(slowest, time.perf_counter_ns() - t0)
            calls += 1
        assert runner.up is False and runner.metrics.errors >= 1
        took = time.monotonic() - t0_s
        print(f"{calls} takes in {took:.1f} s with Redis frozen, slowest {slowest / 1e3:.0f} us")
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
