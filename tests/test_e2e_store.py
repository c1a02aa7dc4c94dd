"""End to end: two `outrate serve` replicas of the tiny model share one budget
through one real redis-server (password-protected: replica A has it in its
URL, replica B in $OUTRATE_STORE_PASSWORD). Pacing is judged on the engines'
own traces, merged: CLOCK_MONOTONIC is one clock for every process here."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

from build_tiny_model import build  # noqa: E402
from e2e_support import REPO, assert_complete  # noqa: E402
from loadgen import run_concurrently  # noqa: E402
from redis_support import RedisServer  # noqa: E402
from serverproc import ServerProcess, cpu_server_env, outrate_serve_argv  # noqa: E402

from outrate.shared import LEASE_INTERVAL_S  # noqa: E402
from outrate.trace import engine_rate, max_window_excess, read_trace, user_tokens  # noqa: E402

pytestmark = pytest.mark.e2e

PASSWORD = "e2e-Pa55word"
RATE = 20
BURST_NS = 100_000_000
N = 2
SLACK = RATE * LEASE_INTERVAL_S + N  # rate * H + N: README "Several engines"
POLICY = "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: 20\n"


class Replicas:
    def __init__(self, redis: RedisServer, servers: list[ServerProcess], traces: list) -> None:
        self.redis = redis
        self.servers = servers
        self.traces = traces

    def steps(self, user: str, since: int, until: int | None = None, which=None):
        time.sleep(0.3)  # the trace is written every 100 ms
        out = []
        for i, path in enumerate(self.traces):
            if which is None or i == which:
                out += user_tokens(read_trace(path), user, since, until)
        return sorted(out)

    def metrics(self, i: int) -> str:
        url = self.servers[i].root_url + "/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)", text, re.M)
    assert m is not None, name
    return float(m.group(1))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    redis = RedisServer(root / "redis", password=PASSWORD).start()
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    model = build(REPO / "models" / "tiny-llama")
    servers, traces = [], []
    # Each worker on its own core: with the default binding both replicas'
    # model workers share core 0, and one replica's step stalled for 1 s
    # while the other's ran (seen in the merged trace).
    for i, (url, env) in enumerate(
        [
            (redis.url, {"VLLM_CPU_OMP_THREADS_BIND": "0"}),
            (
                redis.bare_url,
                {"OUTRATE_STORE_PASSWORD": PASSWORD, "VLLM_CPU_OMP_THREADS_BIND": "1"},
            ),
        ]
    ):
        trace = root / f"trace-{i}.jsonl"
        argv = outrate_serve_argv(
            model,
            policy,
            "--max-num-seqs",
            "16",
            "--max-num-active-seqs",
            "12",
            "--outrate-trace",
            str(trace),
            "--outrate-store",
            url,
        )
        servers.append(
            ServerProcess(
                argv, env=cpu_server_env(env), log_path=root / f"server-{i}.log", name=f"r{i}"
            )
        )
        traces.append(trace)
    errors: list[BaseException] = []

    def start(s: ServerProcess) -> None:
        try:
            s.start(timeout_s=300)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        for s in servers:
            run_concurrently(s.base_url, [("warmup", 1, 8)])
        yield Replicas(redis, servers, traces)
    finally:
        for s in servers:
            s.stop()
        redis.stop()


def run_split(replicas: Replicas, plan: list[list[tuple[str, int, int]]]):
    """Run `plan[i]` on replica i, all at once; returns every stream."""
    results: list = [None] * len(plan)

    def one(i: int) -> None:
        results[i] = run_concurrently(replicas.servers[i].base_url, plan[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(plan))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [s for r in results for s in r]


def test_no_password_in_any_log(replicas):
    for s in replicas.servers:
        log = s.log_path.read_text(errors="replace")
        assert PASSWORD not in log
        assert "sharing budgets through redis://" in log  # the engine says where
        assert "'outrate_store': '***'" in log  # vLLM's non-default args line, redacted


def test_one_user_on_two_replicas_gets_one_rate(replicas):
    """alice: 4 streams, 2 per replica, 50 tokens each. Her tokens summed over
    both engines stay within (W + burst) * rate + 1 + slack in every window
    and reach 0.95 x the rate; an unlimited user beside her is unaffected."""
    since = time.monotonic_ns()
    streams = run_split(replicas, [[("alice", 2, 50), ("free", 1, 400)], [("alice", 2, 50)]])
    assert_complete(streams)
    merged = replicas.steps("alice", since)
    per = [sum(k for _, k in replicas.steps("alice", since, which=i)) for i in range(2)]
    excess = max_window_excess(merged, RATE, BURST_NS)
    rate = engine_rate(merged)
    free = engine_rate(replicas.steps("free", since))
    lease = [
        (
            metric(replicas.metrics(i), "outrate_store_errors_total"),
            metric(replicas.metrics(i), "outrate_lease_seconds_count"),
            metric(replicas.metrics(i), "outrate_lease_seconds_sum"),
        )
        for i in range(2)
    ]
    print(
        f"alice over 2 replicas: {per} tokens, {rate:.2f} tok/s, worst window {excess:+.2f} "
        f"(slack {SLACK:.1f}); free user beside her {free:.0f} tok/s; store errors, round "
        f"trips, mean round trip: {[(e, n, round(t / max(n, 1) * 1000, 2)) for e, n, t in lease]}"
    )
    assert sum(per) == 200
    assert excess <= SLACK
    assert rate >= 0.95 * RATE
    assert min(per) >= 0.35 * 200  # both replicas' streams progress
    assert free > 3 * RATE  # not throttled (its absolute speed is the VM's load)


def test_one_user_on_one_replica_still_gets_the_rate(replicas):
    since = time.monotonic_ns()
    streams = run_split(replicas, [[("alice", 2, 40)], []])
    assert_complete(streams)
    steps = replicas.steps("alice", since)
    excess = max_window_excess(steps, RATE, BURST_NS)
    rate = engine_rate(steps)
    print(f"alice on one replica: {rate:.2f} tok/s, worst window {excess:+.2f}")
    assert excess <= SLACK
    assert rate >= 0.95 * RATE


def test_redis_down_then_back(replicas):
    """Stop Redis mid-run, start it again: every request completes; while it
    is down each replica enforces rate/2; afterwards the shared rate is back,
    and the whole run stays within the bound (the replicas reconnect up to a
    second apart: the first one back stays at rate/2 until the other is)."""
    since = time.monotonic_ns()
    marks: dict[str, int] = {}

    def outage() -> None:
        time.sleep(2.5)
        marks["down"] = time.monotonic_ns()
        replicas.redis.stop()
        time.sleep(4.0)
        replicas.redis.start()
        marks["up"] = time.monotonic_ns()

    t = threading.Thread(target=outage)
    t.start()
    streams = run_split(replicas, [[("alice", 2, 60)], [("alice", 2, 60)]])
    t.join()
    assert_complete(streams)  # no request failed or was cut
    down, up = marks["down"], marks["up"]
    # While down (after the first failed round trip): each replica alone paces
    # at rate/2, within the GCRA bound of rate/2.
    per_down = []
    for i in range(2):
        steps = replicas.steps("alice", down + 300_000_000, up, which=i)
        per_down.append(engine_rate(steps))
        assert max_window_excess(steps, RATE / N, BURST_NS) <= 1e-6
    merged_down = replicas.steps("alice", down + 300_000_000, up)
    after = replicas.steps("alice", up + 300_000_000)
    whole = replicas.steps("alice", since)
    excess = max_window_excess(whole, RATE, BURST_NS)
    print(
        f"outage: per replica {[round(r, 2) for r in per_down]} tok/s (limit {RATE / N}), "
        f"together {engine_rate(merged_down):.2f}; after: {engine_rate(after):.2f} tok/s "
        f"over {len(after)} steps; whole run worst window {excess:+.2f} (slack {SLACK:.1f} "
        f"+ fallback {N})"
    )
    assert all(r <= RATE / N * 1.1 for r in per_down)
    assert engine_rate(merged_down) >= 0.8 * RATE
    assert engine_rate(after) >= 0.8 * RATE
    assert excess <= SLACK + N  # each engine's own +1 while it paced alone
    for i in range(2):
        m = replicas.metrics(i)
        assert metric(m, "outrate_store_up") == 1
        assert metric(m, "outrate_store_errors_total") >= 1
        down_n = metric(m, 'outrate_store_transitions_total{to="down"}')
        assert down_n >= 1 and metric(m, 'outrate_store_transitions_total{to="up"}') == down_n
        assert metric(m, "outrate_store_engines") == 2
        assert metric(m, "outrate_lease_seconds_count") > 10
        log = replicas.servers[i].log_path.read_text(errors="replace")
        assert log.count("budget store") >= 2 and "lost" in log and "is back" in log
