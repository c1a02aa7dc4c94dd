"""End to end on a Redis Cluster: two `outrate serve` replicas of the tiny
model share one budget through a real 3-primary cluster with a replica per
primary (tests/redis_cluster_support.py). While alice runs on both, her
slot's primary is failed over by hand (`CLUSTER FAILOVER`), then the new
primary is killed (SIGKILL) and its replica takes over. Every request
completes; her tokens summed over both engines' traces stay within the
bound across a failover (docs/several-engines.md: S twice, plus each
engine's own +1 while the cluster was down); she has her rate afterwards;
/metrics says which nodes serve and how many failovers each engine saw.

Before that, on the same two engines (each with its quota file): carol's
quota is one count over both (issue 41 item 3). She runs 60 tokens on each
engine against `quota: {output: 100/day}`; each engine's file comes to
show 120, and both refuse her next request with 429 `insufficient_quota`,
though either served her 60 alone (each counting its own, neither would).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

from build_tiny_model import build  # noqa: E402
from e2e_support import REPO, assert_complete, start_together  # noqa: E402
from loadgen import run_concurrently  # noqa: E402
from redis_cluster_support import Cluster  # noqa: E402
from serverproc import ServerProcess, cpu_server_env, outrate_serve_argv  # noqa: E402

from outrate.budget.shared.credit import LEASE_INTERVAL_S  # noqa: E402
from outrate.budget.shared.lease import GROUP_SLOTS, group_of  # noqa: E402
from outrate.observe.trace import engine_rate, max_window_excess, read_trace, user_tokens  # noqa: E402

pytestmark = pytest.mark.e2e

RATE = 20
BURST_NS = 100_000_000
ENGINES = 2
POLICY = (
    "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: 20\n"
    "  carol: {rate: unlimited, quota: {output: 100/day}}\n"
)
S = RATE * LEASE_INTERVAL_S + ENGINES
"""rate * H + N with H = the 20 ms interval: under the stated S, whose H is
the longest horizon sent (after a round that waited out its timeout, over
0.5 s), so stricter than the bound, as in test_e2e_store.py."""
SLACK = 2 * S + ENGINES


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)", text, re.M)
    assert m is not None, name
    return float(m.group(1))


@contextlib.contextmanager
def deployment_up(root: Path):
    """The Redis Cluster and two engines."""
    cluster = Cluster(root / "cluster").start()
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    model = build(REPO / "models" / "tiny-llama")
    servers, traces = [], []
    for i in range(2):
        trace = root / f"trace-{i}.jsonl"
        traces.append(trace)
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
            cluster.url,
            "--outrate-quota-file",
            str(root / f"quota-{i}.json"),
        )
        env = cpu_server_env()  # the model in the engine core (serverproc.CPU_SERVER_ENV)
        servers.append(
            ServerProcess(argv, env=env, log_path=root / f"server-{i}.log", name=f"c{i}")
        )
    try:
        start_together(servers)
        for s in servers:
            run_concurrently(s.base_url, [("warmup", 2, 8)])
        yield cluster, servers, traces, [root / f"quota-{i}.json" for i in range(2)]
    finally:
        for s in servers:
            s.stop()
        cluster.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with deployment_up(tmp_path_factory.mktemp("cluster-e2e")) as value:
        yield value


def _carol(server, tokens: int) -> tuple[int, str]:
    """One completion for carol: (HTTP status, the error code or '')."""
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "hello",
            "max_tokens": tokens,
            "ignore_eos": True,
            "vllm_xargs": {"output_rate_user": "carol"},
        }
    ).encode()
    req = urllib.request.Request(
        server.base_url + "/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()).get("error", {}).get("code", "")


def _carol_total(path: Path) -> int:
    try:
        users = json.loads(path.read_text()).get("users", {})
    except (OSError, ValueError):  # not written yet
        return 0
    return sum(count for _, count in users.get("carol", {}).values())


def test_two_engines_share_one_quota(deployment):
    _, servers, _, files = deployment
    for server in servers:
        assert _carol(server, 60) == (200, "")
    deadline = time.monotonic() + 20  # each saves every 1 s; every user synced every 5 s
    while [_carol_total(f) for f in files] != [120, 120]:
        assert time.monotonic() < deadline, [_carol_total(f) for f in files]
        time.sleep(0.2)
    time.sleep(0.5)  # the API servers read the file every 0.2 s
    refused = [_carol(server, 10) for server in servers]
    print(f"carol: 60 tokens on each engine, both files 120, then {refused}")
    assert refused == [(429, "insufficient_quota")] * 2


def test_two_engines_on_a_cluster_keep_the_bound_through_two_failovers(deployment):
    cluster, servers, traces, _ = deployment
    slot = GROUP_SLOTS[group_of("alice")]
    marks: dict[str, int] = {}

    def faults() -> None:
        time.sleep(2.5)
        primary = cluster.primary_of(slot)
        cluster.failover(cluster.replicas_of(primary)[0])
        marks["failover"] = time.monotonic_ns()
        time.sleep(2.5)
        victim = cluster.primary_of(slot)
        victim.kill()
        marks["killed"] = time.monotonic_ns()
        cluster.wait_taken_over(slot, victim)
        marks["taken_over"] = time.monotonic_ns()

    since = time.monotonic_ns()
    t = threading.Thread(target=faults)
    t.start()
    results: list = [None, None]

    def load(i: int) -> None:
        results[i] = run_concurrently(servers[i].base_url, [("alice", 2, 80)])

    loaders = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for x in loaders:
        x.start()
    for x in loaders:
        x.join()
    t.join()
    assert_complete([s for r in results for s in r])  # every request completed, none cut
    time.sleep(0.3)  # the trace is written every 100 ms
    per = [user_tokens(read_trace(p), "alice", since) for p in traces]
    merged = sorted(per[0] + per[1])
    excess = max_window_excess(merged, RATE, BURST_NS)
    after = [x for x in merged if x[0] >= marks["taken_over"] + 2_000_000_000]
    pages = [
        urllib.request.urlopen(s.root_url + "/metrics", timeout=10).read().decode() for s in servers
    ]
    moved = 'outrate_store_redirects_total{kind="moved"}'
    print(
        f"alice on a cluster: {[sum(k for _, k in p) for p in per]} tokens, "
        f"{engine_rate(merged):.2f} tok/s, worst window {excess:+.2f} (slack {SLACK:.1f}); "
        f"after the kill {engine_rate(after):.2f} tok/s over {len(after)} steps; failovers "
        f"{[metric(p, 'outrate_store_failovers_total') for p in pages]}, moved "
        f"{[metric(p, moved) for p in pages]}"
    )
    assert sum(k for p in per for _, k in p) == 320
    assert excess <= SLACK
    assert len(after) > 10 and engine_rate(after) >= 0.8 * RATE
    for i, page in enumerate(pages):
        assert metric(page, "outrate_store_up") == 1
        assert metric(page, "outrate_store_failovers_total") >= 2
        assert len(re.findall(r"^outrate_store_primary\{node=", page, re.M)) == 3
        log = servers[i].log_path.read_text(errors="replace")
        assert "sharing budgets through redis+cluster://" in log
        assert log.count(": a failover") == metric(page, "outrate_store_failovers_total")
