"""Quota usage counted by the real scheduler and kept across an engine
restart (vllm_integration/step/quotas.py, the engine threads'
`QuotaSaver`), in process: one engine counts and saves to the quota file,
stops; a new scheduler with new threads loads the file, and nobody gets a
fresh window, neither in the engine's book nor in the API server's
decision (`QuotaView`, the code the guard runs). The usage gauges of
/metrics (outrate.observe.quotas) come from the same book, per `limit`
label, and survive the restart too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_ops import rendered  # noqa: E402
from vllm_harness import MS, Driver, FakeClock, make_request, make_scheduler  # noqa: E402

from outrate.contract.quotas import QuotaView  # noqa: E402
from outrate.observe import quotas  # noqa: E402
from outrate.observe.metrics import SNAPSHOT_FILE  # noqa: E402
from outrate.policy.pipeline import load_compiled  # noqa: E402
from vllm_integration.common.settings import EngineSettings  # noqa: E402
from vllm_integration.enginecore.threads import EngineThreads, start_engine_threads  # noqa: E402

pytestmark = pytest.mark.vllm

POLICY = """\
version: 1
default: {rate: 1000, quota: {output: 40/hour}}
users:
  alice: {rate: 1000, quota: {output: 100/day, prompt: 1K/day}}
  bob: 1000
"""


def _engine(tmp_path: Path) -> tuple[object, Driver, EngineThreads]:
    policy = tmp_path / "policy.yaml"
    clock = FakeClock()
    s = make_scheduler("sync", load_compiled(policy), clock)
    settings = EngineSettings(
        policy=str(policy),
        reload="off",
        metrics_dir=str(tmp_path),
        quota_file=str(tmp_path / "quota.json"),
    )
    return s, Driver(s, clock, step_ns=10 * MS), start_engine_threads(s, settings)


def _quota_rows(tmp_path: Path) -> dict[str, dict[str, dict[str, int]]]:
    rows: dict[str, dict[str, dict[str, int]]] = json.loads((tmp_path / SNAPSHOT_FILE).read_text())[
        "quota"
    ]
    return rows


def _page(tmp_path: Path) -> str:
    """The /metrics text of the engine's last snapshot."""
    return rendered(json.loads((tmp_path / SNAPSHOT_FILE).read_text()))


def test_usage_survives_an_engine_restart_and_nobody_gets_a_fresh_window(tmp_path, monkeypatch):
    (tmp_path / "policy.yaml").write_text(POLICY)
    monkeypatch.setattr(quotas, "INTERVAL_S", 0.0)  # every snapshot reads the book
    s, d, threads = _engine(tmp_path)
    try:
        for _ in range(2):
            d.add(make_request("alice", prompt_len=8, max_tokens=30))
        d.add(make_request("carol", max_tokens=45))  # over the default's 40 an hour
        d.add(make_request("dave", max_tokens=10))
        d.add(make_request("bob", max_tokens=5))  # no quota: not counted anywhere
        d.run_until_done()
    finally:
        threads.stop()  # a last save and a last snapshot
    saved = json.loads((tmp_path / "quota.json").read_text())["users"]
    assert saved["alice"]["output/day"][1] == 60 and saved["alice"]["prompt/day"][1] == 16
    assert saved["carol"]["output/hour"][1] == 45  # a stream is never cut: counted whole
    rows = _quota_rows(tmp_path)
    assert rows["alice"] == {
        "output/day": {"used": 60, "spent": 0, "quota": 100},
        "prompt/day": {"used": 16, "spent": 0, "quota": 1000},
    }
    # carol and dave are not listed: one series for the default's users
    assert rows["default"] == {"output/hour": {"used": 55, "spent": 1, "quota": 40}}
    assert "bob" not in rows and "carol" not in rows

    policy = load_compiled(tmp_path / "policy.yaml")
    view = QuotaView(str(tmp_path / "quota.json"))
    spent = view.spent(policy.limit_for("carol"), "carol")
    assert spent is not None and spent.quota.window == "hour" and spent.used == 45
    assert view.spent(policy.limit_for("alice"), "alice") is None

    # the restart: a new scheduler and new threads load the file
    s2, d2, threads2 = _engine(tmp_path)
    try:
        book = threads2.quota.book  # type: ignore[union-attr]
        assert book.used("alice", "output", "day") == 60  # before any request
        assert book.used("carol", "output", "hour") == 45
        threads2.publisher.publish()  # type: ignore[union-attr]
        assert _quota_rows(tmp_path)["alice"]["output/day"]["used"] == 60  # the gauge too
        d2.add(make_request("alice", prompt_len=8, max_tokens=50))
        d2.run_until_done()
    finally:
        threads2.stop()
    saved = json.loads((tmp_path / "quota.json").read_text())["users"]
    assert saved["alice"]["output/day"][1] == 110 and saved["alice"]["prompt/day"][1] == 24
    assert saved["carol"]["output/hour"][1] == 45
    view = QuotaView(str(tmp_path / "quota.json"))
    spent = view.spent(policy.limit_for("alice"), "alice")
    assert spent is not None and spent.used == 110 and spent.quota.tokens == 100
    assert view.spent(policy.limit_for("carol"), "carol") is not None
    assert _quota_rows(tmp_path)["alice"]["output/day"] == {"used": 110, "spent": 1, "quota": 100}
    page = _page(tmp_path)
    assert 'outrate_quota_used_tokens{kind="output",limit="alice",window="day"} 110.0' in page
    assert 'outrate_quota_tokens{kind="output",limit="alice",window="day"} 100.0' in page
    assert 'outrate_quota_spent_users{kind="output",limit="default",window="hour"} 1.0' in page
