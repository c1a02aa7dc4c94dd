"""The store benchmark runs and its numbers are sane (timing targets are not
asserted here: this machine is too noisy for that)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("redis")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_store as bench  # noqa: E402
from redis_support import RedisServer  # noqa: E402

pytestmark = pytest.mark.waits  # make test's waits lane (tests/lanes.py)


def test_bench_store_parts_run(tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        rt = bench.round_trips(server.url, 50, 0.5)
        assert rt["calls_per_rt"] >= 1 and rt["rt_per_s"] > 5
        assert 1 <= rt["scripts_per_rt"] <= rt["calls_per_rt"]
        assert rt["excess"] <= rt["slack"]
        assert rt["tok_per_user_s"] > 0
        waits = bench.first_credit(server.url, 3)
        assert all(w < 1000 for w in waits)
        over = bench.overshoot(server.url, 2, 50, 1.0)
        assert over["excess"] <= over["slack"]
    finally:
        server.stop()
