"""End to end: a Redis outage never stops a limited user (issue 35). Two
`outrate serve` engines of the tiny model share one budget through one real
redis-server, with the default fallback (`local`) and a hold of 8 s
(`--outrate-store-hold-s 8`: the default 30 s would make the outage 45 s
of waiting; what the hold does is the same). One module, one pair of
server starts, in the order an operator would meet it:

1. Both engines start while Redis is down: A is told it is one of two
   (`--outrate-store-engines 2`) and serves alice at rate/2; B is told
   nothing, says so in its log (N = 1) and serves her at the full rate.
2. Redis comes up: both join, and alice's tokens over both engines obey the
   shared bound.
3. Redis is stopped for 18 s, past the hold. Alice's requests sent 10 s into
   the outage complete on both engines, each engine at most rate/2 by its
   own trace; the engines report `outrate_store_fallback_seconds` past the
   hold (the alert's signal); once Redis is back, the bound over both engines
   holds again within seconds.

Pacing is judged on the engines' own traces, merged (CLOCK_MONOTONIC is one
clock for every process here)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

from build_tiny_model import build  # noqa: E402
from e2e_support import REPO, assert_complete, engines_allowed, start_together  # noqa: E402
from loadgen import run_concurrently  # noqa: E402
from redis_support import RedisServer  # noqa: E402
from serverproc import (  # noqa: E402
    ServerProcess,
    cpu_server_env,
    outrate_serve_argv,
    play_unstarved,
)

from outrate.budget.shared.credit import LEASE_INTERVAL_S  # noqa: E402
from outrate.observe.trace import engine_rate, max_window_excess, read_trace, user_tokens  # noqa: E402

pytestmark = pytest.mark.e2e

RATE = 20
BURST_NS = 100_000_000
N = 2
S_NS = 1_000_000_000
SLACK = RATE * LEASE_INTERVAL_S + N
"""rate * H + N with H the 20 ms interval (docs/several-engines.md, "The bound")."""
OUTAGE_S = 18.0
HOLD_S = 8.0
SENT_S = 10.0
"""Alice's requests during the outage are sent this long into it: past the hold."""
ACROSS_S = 5.0
"""Requests across Redis's return are sent this long before it."""
POLICY = "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: 20\n"
A, B = 0, 1


class Pair:
    def __init__(self, redis: RedisServer, servers: list[ServerProcess], traces: list) -> None:
        self.redis = redis
        self.servers = servers
        self.traces = traces

    def steps(self, since: int, until: int | None = None, engine: int | None = None):
        time.sleep(0.3)  # the trace is written every 100 ms
        out = []
        for i, path in enumerate(self.traces):
            if engine is None or i == engine:
                out += user_tokens(read_trace(path), "alice", since, until)
        return sorted(out)

    def metric(self, i: int, name: str) -> float:
        url = self.servers[i].root_url + "/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)", text, re.M)
        assert m is not None, name
        return float(m.group(1))

    def log(self, i: int) -> str:
        return self.servers[i].log_path.read_text(errors="replace")

    def run(self, plan: list[list[tuple[str, int, int]]]):
        """Run `plan[i]` on engine i, all at once; returns every stream."""
        results: list = [None] * len(plan)

        def one(i: int) -> None:
            results[i] = run_concurrently(self.servers[i].base_url, plan[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(plan))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [s for r in results for s in r]


def wait_for(what, timeout_s: float = 20.0) -> float:
    """Poll `what()` until true; the seconds it took."""
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < timeout_s, what.__doc__
        time.sleep(0.1)
    return time.monotonic() - t0


@contextlib.contextmanager
def pair_up(root: Path):
    """The two engines, without Redis."""
    redis = RedisServer(root / "redis")  # not started: both engines start without it
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    model = build(REPO / "models" / "tiny-llama")
    common = ["--max-num-seqs", "16", "--max-num-active-seqs", "12"]
    common += ["--outrate-store", redis.url]
    traces = [root / "trace-a.jsonl", root / "trace-b.jsonl"]
    common += ["--outrate-store-hold-s", f"{HOLD_S:g}"]
    told = [["--outrate-store-engines", str(N)], []]
    servers = [
        ServerProcess(
            outrate_serve_argv(model, policy, *common, "--outrate-trace", str(traces[i]), *told[i]),
            env=cpu_server_env(),  # the model in the engine core (serverproc.CPU_SERVER_ENV)
            log_path=root / f"server-{name}.log",
            name=name,
        )
        for i, name in enumerate("ab")
    ]
    try:
        start_together(servers)
        print(f"started without Redis: {[round(s.startup_s or 0) for s in servers]} s")
        yield Pair(redis, servers, traces)
    finally:
        for s in servers:
            s.stop()
        redis.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with pair_up(tmp_path_factory.mktemp("outage")) as value:
        yield value


def test_engines_started_without_redis_serve_then_join(pair):
    """Started while Redis is down: each serves alice at rate/N with the N it
    was told (A: 2 from --outrate-store-engines; B: 1, and its log says
    neither flag was given), then joins the shared budget when Redis
    comes up."""
    for i in (A, B):
        assert pair.metric(i, "outrate_store_up") == 0
        assert pair.metric(i, "outrate_store_waiting") == 0
    assert (
        "enforcing rate/2 on this engine until it answers (N = 2 from --outrate-store-engines)"
        in (pair.log(A))
    )
    assert "enforcing rate/1 on this engine until it answers (N = 1: neither " in pair.log(B)
    since = time.monotonic_ns()
    streams = pair.run([[("alice", 2, 30)], [("alice", 2, 40)]])
    assert_complete(streams)  # served, not paused
    cold = [pair.steps(since, engine=e) for e in (A, B)]
    rates = [engine_rate(s) for s in cold]
    excess = [max_window_excess(s, RATE / n, BURST_NS) for s, n in zip(cold, (N, 1), strict=True)]
    print(f"cold start: alice {rates[0]:.2f} tok/s on A (rate/2), {rates[1]:.2f} on B (rate/1)")
    assert excess[0] <= 1e-6 and excess[1] <= 1e-6  # each within its local GCRA
    assert rates[0] >= 0.8 * RATE / N and rates[1] >= 0.8 * RATE
    t0 = time.monotonic()
    pair.redis.start()
    joined = wait_for(lambda: all(pair.metric(i, "outrate_store_up") == 1 for i in (A, B)))
    print(f"both joined {joined + 0.0:.1f} s after Redis came up")
    assert all(
        "sharing budgets through" in pair.log(i) and "after all" in pair.log(i) for i in (A, B)
    )
    time.sleep(max(0.0, 6.0 - (time.monotonic() - t0)))  # past the grace (<= 5 s)

    def play() -> int:
        since = time.monotonic_ns()
        assert_complete(pair.run([[("alice", 2, 40)], [("alice", 2, 40)]]))
        return since

    # Played again once if the machine starved the engines (in one fresh
    # run, the lanes beside it, 17.995 tok/s against 0.9 x 20); judged
    # against what one exact GCRA grants at the times the engines stepped
    # (another fresh run: 17.82 tok/s against 0.9 x 20).
    since = play_unstarved(pair.servers, play)
    shared = pair.steps(since)
    excess = max_window_excess(shared, RATE, BURST_NS)
    allowed = engines_allowed(pair.traces, shared, RATE, BURST_NS, 4)
    print(
        f"shared after joining: {engine_rate(shared):.2f} tok/s (the engines' steps allowed "
        f"{allowed:.2f}), worst window {excess:+.2f}"
    )
    assert excess <= SLACK
    assert engine_rate(shared) >= 0.9 * allowed


def test_an_outage_past_the_hold_does_not_stop_a_limited_user(pair):
    """Redis down 18 s, past the 8 s hold. Alice's requests sent 10 s in
    complete on both engines, each at most rate/2 on its own trace (the
    fallback `local`: rate/N for the whole outage); the engines say how long
    they have been on it (`outrate_store_fallback_seconds`, past the hold:
    OutrateStoreFallbackLong); requests that run across Redis's return keep
    going, and the bound over both engines holds again within seconds."""
    pair.redis.stop()
    down = time.monotonic_ns()
    time.sleep(SENT_S)
    since = time.monotonic_ns()
    streams = pair.run([[("alice", 2, 30)], [("alice", 2, 30)]])
    assert_complete(streams)  # new requests complete during the outage
    during = [pair.steps(since, engine=e) for e in (A, B)]
    fallback_s = [pair.metric(i, "outrate_store_fallback_seconds") for i in (A, B)]
    holds = [pair.metric(i, "outrate_store_hold_seconds") for i in (A, B)]
    waiting = [pair.metric(i, "outrate_store_waiting") for i in (A, B)]
    left = OUTAGE_S - ACROSS_S - (time.monotonic_ns() - down) / S_NS
    # Requests across Redis's return: sent ACROSS_S before it, running past it.
    result: list = []
    runner = threading.Thread(
        target=lambda: result.extend(pair.run([[("alice", 2, 90)], [("alice", 2, 90)]]))
    )
    time.sleep(max(0.0, left))
    across = time.monotonic_ns()
    runner.start()
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic_ns() - down) / S_NS))
    pair.redis.start()
    up = time.monotonic_ns()
    back = wait_for(lambda: all(pair.metric(i, "outrate_store_up") == 1 for i in (A, B)))
    runner.join()
    assert_complete(result)
    rates = [engine_rate(s) for s in during]
    local = [max_window_excess(s, RATE / N, BURST_NS) for s in during]
    merged_during = sorted(during[0] + during[1])
    whole = pair.steps(across)
    # How soon after Redis came back every window holds the shared bound.
    settled = next(
        (
            t / 2
            for t in range(0, 21)
            if max_window_excess(pair.steps(up + t * S_NS // 2), RATE, BURST_NS) <= SLACK
        ),
        None,
    )
    after = pair.steps(up + 6 * S_NS)
    print(
        f"{OUTAGE_S:.0f} s outage, requests {SENT_S:.0f} s in: alice "
        f"{[round(r, 2) for r in rates]} tok/s per engine "
        f"(local bound rate/2 = {RATE / N:.0f}), {engine_rate(merged_during):.2f} together, worst "
        f"local window {[round(x, 2) for x in local]}; fallback {fallback_s} s against a hold of "
        f"{holds}; both back {back:.1f} s after Redis; across the return: worst window "
        f"{max_window_excess(whole, RATE, BURST_NS):+.2f} (B + S + N: slack {SLACK + N:.1f}); "
        f"the shared bound holds from {settled} s after Redis came back; from 6 s on: "
        f"{engine_rate(after):.2f} tok/s"
    )
    assert waiting == [0, 0]  # nobody paused
    assert all(f > h == HOLD_S for f, h in zip(fallback_s, holds, strict=True))
    assert all(x <= 1e-6 for x in local)  # each engine within rate/2, alone
    assert all(r <= RATE / N * 1.1 for r in rates)
    assert engine_rate(merged_during) >= 0.8 * RATE
    assert max_window_excess(whole, RATE, BURST_NS) <= SLACK + N
    assert settled is not None and settled <= 5.0
    assert engine_rate(after) >= 0.8 * RATE
    for i in (A, B):
        assert pair.metric(i, "outrate_store_fallback_seconds") == 0
        log = pair.log(i)
        assert "until it answers" in log and "still lost" not in log and "is back" in log
