"""The engine core's threads, wired to a real scheduler: the reloader (here in
poll mode, which `--outrate-reload poll` selects), the metrics publisher and
the trace writer."""

from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("vllm")

from vllm_harness import MS, Driver, FakeClock, make_request, make_scheduler  # noqa: E402

from outrate.observe.metrics import SNAPSHOT_FILE  # noqa: E402
from outrate.observe.trace import read_trace  # noqa: E402
from outrate.policy.pipeline import load_compiled  # noqa: E402
from vllm_integration.common.settings import EngineSettings  # noqa: E402
from vllm_integration.enginecore.threads import start_engine_threads  # noqa: E402

pytestmark = pytest.mark.vllm


def test_engine_threads_reload_publish_and_trace(tmp_path):
    policy = tmp_path / "policy.yaml"
    first = "version: 1\ndefault: 100\nusers:\n  alice: 20\n"
    policy.write_text(first)
    clock = FakeClock()
    s = make_scheduler("sync", load_compiled(policy), clock)
    settings = EngineSettings(
        policy=str(policy),
        reload="poll",
        metrics_dir=str(tmp_path),
        trace=str(tmp_path / "trace.jsonl"),
    )
    threads = start_engine_threads(s, settings)
    try:
        assert threads.reloader is not None and threads.reloader.observer_kind == "polling"
        d = Driver(s, clock, step_ns=10 * MS)
        d.add(make_request("alice", max_tokens=5))
        d.run_until_done()
        policy.write_text("version: 1\ndefault: 100\nusers:\n  alice: 60\n")
        assert threads.reloader.wait_applied(1, timeout=5)
        assert s.policy_box.current.limit_for("alice").rate == 60
    finally:
        threads.stop()
    snap = json.loads((tmp_path / SNAPSHOT_FILE).read_text())
    assert snap["labels"]["alice"]["tokens"] == 5
    assert snap["reloads"] == {"applied": 1, "rejected": 0}
    assert snap["policy"]["sha256"] == s.policy_box.current.sha256
    lines = read_trace(tmp_path / "trace.jsonl")
    assert lines[0]["trace"] == "outrate"
    assert lines[0]["policy"] == hashlib.sha256(first.encode()).hexdigest()
    assert sum(r.get("charged", {}).get("alice", 0) for r in lines) == 5
