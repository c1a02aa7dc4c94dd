"""End to end: `--data-parallel-size 2` with a budget store, on the tiny model
on CPU. vLLM 0.32 runs data parallel on CPU (two engine cores, two workers,
two API servers; ~2.5 min to start on two cores). Each engine core has its
own scheduler and lease thread; the store makes them one budget."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

from build_tiny_model import build  # noqa: E402
from e2e_support import REPO, assert_complete  # noqa: E402
from loadgen import run_concurrently  # noqa: E402
from redis_support import RedisServer  # noqa: E402
from serverproc import ServerProcess, outrate_serve_argv  # noqa: E402

from outrate.lease import ENGINES_KEY  # noqa: E402
from outrate.shared import LEASE_INTERVAL_S  # noqa: E402
from outrate.trace import engine_rate, max_window_excess, read_trace, user_tokens  # noqa: E402

pytestmark = pytest.mark.e2e

RATE = 20
SLACK = RATE * LEASE_INTERVAL_S + 2


def test_data_parallel_engines_share_one_budget(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: 20\n")
    trace = tmp_path / "trace.jsonl"
    argv = outrate_serve_argv(
        build(REPO / "models" / "tiny-llama"),
        policy,
        "--data-parallel-size",
        "2",
        "--max-num-seqs",
        "16",
        "--max-num-active-seqs",
        "12",
        "--outrate-store",
        redis.url,
        "--outrate-trace",
        str(trace),
    )
    server = ServerProcess(argv, log_path=tmp_path / "server.log", name="dp2")
    try:
        server.start(timeout_s=420)
        engines = redis.client().hgetall(ENGINES_KEY)
        assert len(engines) == 2  # both engine cores heartbeat
        since = time.monotonic_ns()
        streams = run_concurrently(server.base_url, [("alice", 4, 30)])
        assert_complete(streams)
        time.sleep(0.3)
        per_rank = [
            user_tokens(read_trace(tmp_path / f"trace.dp{r}.jsonl"), "alice", since)
            for r in range(2)
        ]
        merged = sorted(per_rank[0] + per_rank[1])
        counts = [sum(k for _, k in steps) for steps in per_rank]
        excess = max_window_excess(merged, RATE, 100_000_000)
        rate = engine_rate(merged)
        print(
            f"data parallel 2: alice {counts} tokens per rank, {rate:.2f} tok/s, worst "
            f"window {excess:+.2f} (slack {SLACK:.1f}); started in {server.startup_s:.0f} s"
        )
        assert sum(counts) == 120
        assert excess <= SLACK
        assert rate >= 0.9 * RATE
    finally:
        server.stop()
        redis.stop()
