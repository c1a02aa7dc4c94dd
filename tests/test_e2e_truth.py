"""End to end, engine-side truth: outrate's metrics on vLLM's own /metrics agree
with the engine's token trace, shadow rules count without enforcing, an edit
to enforce caps the user, and `outrate top` reads it all from a real server.
Shares the session's `outrate serve` (conftest.py)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")

from e2e_support import POLICY, assert_complete, engine_steps, wait_idle  # noqa: E402
from loadgen import Stream, client, run_concurrently, stream_completion  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from outrate.observe.trace import engine_rate, max_window_excess, read_trace  # noqa: E402

pytestmark = pytest.mark.e2e

S = 1_000_000_000


def scrape(server) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """outrate's samples on the server's /metrics: name -> {labels: value}."""
    text = urllib.request.urlopen(server.root_url + "/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("outrate_"):
                key = tuple(sorted(sample.labels.items()))
                out.setdefault(sample.name, {})[key] = sample.value
    return out


def by_limit(samples: dict[str, dict], name: str) -> dict[str, float]:
    return {dict(k)["limit"]: v for k, v in samples.get(name, {}).items()}


def trace_totals(server, key: str = "charged") -> dict[str, int]:
    """Net tokens (or `over` tokens) per user id over the whole trace."""
    totals: dict[str, int] = {}
    for rec in read_trace(server.trace_path):
        for user, n in rec.get(key, {}).items():
            totals[user] = totals.get(user, 0) + n
        if key == "charged":
            for user, n in rec.get("refunded", {}).items():
                totals[user] = totals.get(user, 0) - n
    return totals


def wait_for(predicate, timeout_s: float = 5.0):
    """Poll until `predicate()` is truthy (the metrics snapshot is published
    every 0.5 s, the trace flushed every 0.1 s); returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_metrics_on_vllm_metrics_agree_with_the_engine_trace(server):
    # The session's server has served other modules under other policies
    # (a user is counted under the rule that named it then): compare what
    # this test adds, from a point where both sides are at rest.
    wait_idle(server)
    time.sleep(1.0)  # the metrics snapshot is published every 0.5 s
    counted_before = by_limit(scrape(server), "outrate_output_tokens_total")
    traced_before = trace_totals(server)
    streams = run_concurrently(
        server.base_url, [("slow", 2, 10), ("acc-100-1", 1, 60), ("someone", 1, 30), (None, 1, 8)]
    )
    assert_complete(streams)
    listed = set(yaml.safe_load(POLICY)["users"])

    def agree() -> tuple[dict, dict] | None:
        samples = scrape(server)
        tokens = {
            label: n - counted_before.get(label, 0)
            for label, n in by_limit(samples, "outrate_output_tokens_total").items()
        }
        totals = {u: n - traced_before.get(u, 0) for u, n in trace_totals(server).items()}
        expected: dict[str, int] = {}
        for user, n in totals.items():
            label = user if user in listed else "default"
            if user == "__anonymous__":
                label = "anonymous"
            expected[label] = expected.get(label, 0) + n
        ok = all(tokens.get(label) == n for label, n in expected.items() if n)
        # Requests of earlier tests that were cut (closed streams) leave the
        # engine when their abort arrives: wait for every gauge to drain too.
        drained = all(
            set(by_limit(samples, gauge).values()) <= {0}
            for gauge in ("outrate_held_requests", "outrate_live_requests")
        )
        return (samples, expected) if ok and drained else None

    result = wait_for(agree)
    samples = scrape(server)
    assert result is not None, (
        by_limit(samples, "outrate_output_tokens_total"),
        trace_totals(server),
    )
    samples, expected = result
    assert expected["slow"] >= 20 and expected["default"] >= 30 and expected["anonymous"] >= 8
    # Nothing in flight: every gauge back to zero.
    held = by_limit(samples, "outrate_held_requests")
    live = by_limit(samples, "outrate_live_requests")
    assert set(held.values()) == {0} and set(live.values()) == {0}
    # The limits as configured, and the policy in force.
    limits = samples["outrate_limit_tokens_per_second"]
    assert limits[(("limit", "slow"), ("mode", "enforce"))] == 20
    assert limits[(("limit", "default"), ("mode", "enforce"))] == float("inf")
    # (A test before may have just restored the file: the reload lags by <= 1 s.)
    digest = hashlib.sha256(Path(server.policy_path).read_bytes()).hexdigest()
    policy_info = {"sha256": digest, "source": str(server.policy_path)}
    wait_for(lambda: [dict(i) for i in scrape(server)["outrate_policy_info"]] == [policy_info])
    (info,) = scrape(server)["outrate_policy_info"]
    assert dict(info) == policy_info
    # One token-interval observation per token after each request's first.
    intervals = by_limit(samples, "outrate_token_interval_seconds_count")
    assert 0 < intervals["acc-100-1"] < trace_totals(server)["acc-100-1"]
    print(
        "tokens per limit, /metrics == trace: "
        + ", ".join(f"{k}={v}" for k, v in sorted(expected.items()))
    )


def test_a_shadow_rule_counts_without_enforcing_and_an_edit_enforces_it(server):
    path: Path = server.policy_path
    since = time.monotonic_ns()
    over_before = trace_totals(server, "over").get("shadowy", 0)
    streams = run_concurrently(server.base_url, [("shadowy", 2, 60)])
    assert_complete(streams)
    shadow_rate = engine_rate(engine_steps(server, "shadowy", since))
    over = trace_totals(server, "over").get("shadowy", 0) - over_before
    assert shadow_rate > 2 * 20  # ran past its 20 tok/s limit: not enforced
    assert over > 60  # ...and the tokens over the limit were counted

    def counter_agrees() -> bool:
        counted = by_limit(scrape(server), "outrate_shadow_over_limit_tokens_total")
        return counted.get("shadowy") == trace_totals(server, "over")["shadowy"]

    assert wait_for(counter_agrees)
    limits = scrape(server)["outrate_limit_tokens_per_second"]
    assert limits[(("limit", "shadowy"), ("mode", "shadow"))] == 20

    # Shadow -> enforce is an edit of the file, applied while a stream runs.
    long_run = Stream("shadowy", 2000)
    worker = threading.Thread(
        target=stream_completion,
        args=(client(server.base_url), "shadowy", 2000),
        kwargs={"stream": long_run},
        daemon=True,
    )
    worker.start()
    time.sleep(1.5)
    edited_at = time.monotonic_ns()
    path.write_text(POLICY.replace("shadowy: {rate: 20, shadow: true}", "shadowy: 20"))
    time.sleep(3.5)
    long_run.close()
    worker.join(timeout=30)
    path.write_text(POLICY)
    steps = engine_steps(server, "shadowy", edited_at - 1 * S)
    before = sum(k for t, k in steps if t < edited_at) / 1.0
    capped = [(t, k) for t, k in steps if t >= edited_at + 1 * S]
    capped_rate = sum(k for _, k in capped) / 2.5
    print(
        f"shadowy (engine): {shadow_rate:.0f} tok/s in shadow ({over} tokens over the limit), "
        f"{before:.0f} tok/s just before the edit, {capped_rate:.1f} tok/s from 1 s after it"
    )
    assert before > 2 * 20
    assert capped and max_window_excess(capped, 20, 100_000_000) <= 1e-6
    assert capped_rate <= 20 * 1.1
    limits = wait_for(
        lambda: scrape(server)["outrate_limit_tokens_per_second"].get(
            (("limit", "shadowy"), ("mode", "shadow"))
        )
    )
    assert limits == 20  # the file is back to the shadow rule: so is the gauge


def test_outrate_top_once_reads_a_real_server(server):
    run_concurrently(server.base_url, [("acc-20-1", 1, 5)])
    top = subprocess.run(
        [sys.executable, "-m", "outrate", "top", server.root_url, "--once", "--interval", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert top.returncode == 0, top.stderr
    digest = hashlib.sha256(Path(server.policy_path).read_bytes()).hexdigest()
    assert f"policy {digest[:12]}" in top.stdout
    rows = {line.split()[0]: line.split() for line in top.stdout.splitlines() if line.strip()}
    assert rows["acc-20-1"][3] == "20" and rows["acc-20-1"][5] == "enforce"
    assert rows["shadowy"][5] == "shadow"
    print(top.stdout)
