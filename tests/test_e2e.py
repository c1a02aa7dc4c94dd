"""End to end: a real `outrate serve` on the tiny local model, driven by the
official `openai` client. One server is shared by the whole session
(conftest.py; an engine takes 20-40 s to start on two cores)."""

from __future__ import annotations

import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

from e2e_support import (  # noqa: E402
    BURST_NS,
    POLICY,
    assert_complete,
    check_pacing,
    engine_steps,
    step_intervals,
    step_rate,
    trace_steps,
    wait_reloaded,
)
from loadgen import (  # noqa: E402
    Stream,
    client,
    run_concurrently,
    stream_completion,
    throughput,
)
from serverproc import cpu_seconds  # noqa: E402

from outrate.observe.trace import engine_rate, gcra_allowed, read_trace  # noqa: E402
from outrate.observe.trace import max_window_excess as engine_excess  # noqa: E402

S_NS = 1_000_000_000


def wait_swapped(server, since_ns: int, timeout_s: float = 30) -> int:
    """When the scheduler swapped to a reloaded policy, at a step's start:
    the trace's first policy line from `since_ns` on (the reloader's log
    line is when it handed the policy over)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        swaps = [
            r["t"]
            for r in read_trace(server.trace_path)
            if "policy" in r and "trace" not in r and r["t"] >= since_ns  # not the header
        ]
        if swaps:
            return swaps[0]
        time.sleep(0.05)
    raise AssertionError(f"no policy swap in the trace within {timeout_s} s")


pytestmark = pytest.mark.e2e


def test_limits_hold_with_one_and_four_streams(server):
    plan = [
        ("acc-20-1", 1, 80),
        ("acc-20-4", 4, 20),
        ("acc-100-1", 1, 400),
        ("acc-100-4", 4, 100),
        ("unlimited-user", 1, 600),
    ]
    since = time.monotonic_ns()
    streams = run_concurrently(server.base_url, plan)
    assert_complete(streams)
    report: list[str] = []
    try:
        for user, limit in (
            ("acc-20-1", 20),
            ("acc-20-4", 20),
            ("acc-100-1", 100),
            ("acc-100-4", 100),
        ):
            check_pacing(server, streams, user, limit, since, report)
        # The unlimited user is served in every engine step while it runs: its
        # rate is the engine's step rate, whatever this machine's speed is.
        lines = trace_steps(server, since)
        free = engine_rate(engine_steps(server, "unlimited-user", since))
        steps_per_s = step_rate(lines, "unlimited-user")
        report.append(f"unlimited-user: engine {free:.1f} tok/s in {steps_per_s:.1f} steps/s")
    finally:
        print("\n".join(report))
    assert free >= 0.95 * steps_per_s, report


def test_an_unlimited_user_is_not_slowed_by_throttled_ones(server):
    """On the engine's record: every scheduler step from the unlimited user's
    first token to its last served it, and while throttled streams sit held
    beside it no step does more work for them: stock's loop visits only the
    unlimited user's request (the trace's `running`). That is what "held
    requests add no work" means, and it does not depend on what else runs on
    the machine. The wall-clock step length and the end-to-end rate beside
    held streams are printed against alone, not asserted: on two shared cores
    a neighbour's load moves them (a fresh-clone run read a step ratio of 1.23
    with another process busy; alone it read 0.90-0.99)."""
    alone_ms: list[float] = []
    held_ms: list[float] = []
    visited: list[int] = []
    rates: dict[str, list[float]] = {"alone": [], "beside": []}
    client_rates: dict[str, list[float]] = {"alone": [], "beside": []}
    skipped = 0

    def measure(side: str) -> None:
        nonlocal skipped
        plan = [("free", 1, 300)] + ([("slow", 4, 8)] if side == "beside" else [])
        since = time.monotonic_ns()
        streams = run_concurrently(server.base_url, plan)
        assert_complete(streams)
        intervals, missed, seen = step_intervals(
            server, "free", since, beside="slow" if side == "beside" else None
        )
        (held_ms if side == "beside" else alone_ms).extend(intervals)
        if side == "beside":
            visited.extend(seen)
        skipped += missed
        rates[side].append(engine_rate(engine_steps(server, "free", since)))
        client_rates[side].append(throughput(streams, "free"))

    # Interleaved, alternating order: the machine's own drift hits both sides.
    for i in range(3):
        for side in ("alone", "beside") if i % 2 == 0 else ("beside", "alone"):
            measure(side)
    step_ratio = statistics.median(held_ms) / statistics.median(alone_ms)
    ratio = statistics.median(rates["beside"]) / statistics.median(rates["alone"])
    client = statistics.median(client_rates["beside"]) / statistics.median(client_rates["alone"])
    print(
        f"unlimited user: {skipped} engine steps without it; {len(visited)} steps beside "
        f"held streams visited {sorted(set(visited))} requests; median step "
        f"{statistics.median(alone_ms):.2f} ms alone, {statistics.median(held_ms):.2f} ms "
        f"beside held streams: ratio {step_ratio:.2f}. Engine rate "
        f"alone {[round(x) for x in rates['alone']]} tok/s, beside 4 throttled streams "
        f"{[round(x) for x in rates['beside']]}: median ratio {ratio:.2f} "
        f"(client-side {client:.2f})"
    )
    assert skipped == 0  # held requests never cost it a step
    assert len(visited) >= 50
    assert set(visited) == {1}  # nor any work in a step: the loop sees its request alone


def test_throttled_answers_complete_untruncated(server):
    streams = run_concurrently(server.base_url, [("slow", 3, 12)])
    assert_complete(streams)


def test_a_client_disconnect_hurts_nobody(server):
    api = client(server.base_url)
    cut = stream_completion(api, "slow", 200, cancel_after=3)
    assert cut.error is None and len(cut.token_times) == 3
    survivors = run_concurrently(server.base_url, [("slow", 2, 8), ("free", 1, 50)])
    assert_complete(survivors)
    metrics = urllib.request.urlopen(server.root_url + "/metrics", timeout=10).read().decode()
    running = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)", metrics, re.M)
    assert running is not None and float(running.group(1)) == 0  # the cut request is gone


def test_requests_without_identity_share_the_anonymous_budget(server):
    since = time.monotonic_ns()
    streams = run_concurrently(server.base_url, [(None, 3, 25)])
    assert_complete(streams)
    report: list[str] = []
    check_pacing(server, streams, None, 30, since, report)
    print("\n".join(report))


def test_long_prompts_and_prefix_cache_hits_pay_for_the_first_token(server):
    api = client(server.base_url)
    long_prompt = "rate limits keep engines fair. " * 120  # about 1200 tokens
    since = time.monotonic_ns()
    runs = [stream_completion(api, "prompt-user", 10)]
    runs += [stream_completion(api, "prompt-user", 3, prompt=long_prompt) for _ in range(2)]
    assert_complete(runs)
    steps = engine_steps(server, "prompt-user", since)
    # 16 tokens at 20 tok/s with a 100 ms burst, prompts and cache hits
    # included: the GCRA bound holds in every window on the engine's record.
    assert sum(k for _, k in steps) == 16
    assert engine_excess(steps, 20, BURST_NS) <= 1e-6


@pytest.mark.parametrize("bad", [5, "", "x" * 300, "tab\there", "__anonymous__"])
def test_a_bad_identity_is_refused_with_400(server, bad):
    from openai import BadRequestError

    api = client(server.base_url)
    with pytest.raises(BadRequestError) as exc:
        api.completions.create(
            model="tiny",
            prompt="hi",
            max_tokens=4,
            extra_body={"vllm_xargs": {"output_rate_user": bad}},
        )
    assert "output_rate_user" in str(exc.value)
    ok = api.completions.create(
        model="tiny",
        prompt="hi",
        max_tokens=4,
        extra_body={"ignore_eos": True, "vllm_xargs": {"output_rate_user": "fine"}},
    )
    assert ok.usage.completion_tokens == 4


def test_beam_search_is_refused_with_400(server):
    from openai import BadRequestError

    api = client(server.base_url)
    with pytest.raises(BadRequestError, match="beam search is not supported"):
        api.completions.create(
            model="tiny", prompt="hi", max_tokens=4, n=2, extra_body={"use_beam_search": True}
        )


def test_the_engine_waits_instead_of_spinning_when_everyone_is_throttled(server):
    worker = threading.Thread(
        target=run_concurrently, args=(server.base_url, [("crawl", 4, 2)]), daemon=True
    )
    worker.start()
    # Burst spent, all four streams throttled at 1 tok/s; 8 tokens last ~8 s,
    # past the 3.5 s judged here (16 tokens made the test wait 16 s).
    time.sleep(1.0)
    metrics = urllib.request.urlopen(server.root_url + "/metrics", timeout=10).read().decode()
    held = re.search(r'^outrate_held_requests\{limit="crawl"\} (\S+)', metrics, re.M)
    assert held is not None and float(held.group(1)) >= 3, metrics[-2000:]
    pids = server.engine_core_pids()
    assert pids
    c0, t0 = sum(cpu_seconds(p) for p in pids), time.monotonic()
    time.sleep(2.5)
    share = (sum(cpu_seconds(p) for p in pids) - c0) / (time.monotonic() - t0)
    worker.join()
    print(f"engine-core CPU while every request is throttled: {share:.1%} of a core")
    assert share < 0.15


def test_a_user_with_many_streams_cannot_lock_others_out(server):
    api = client(server.base_url)

    def ttft(user: str) -> float:
        s = stream_completion(api, user, 1)
        assert s.error is None
        return s.ttft

    solo = statistics.median(ttft("newcomer") for _ in range(3))
    hogs = [Stream("hog", 1000) for _ in range(48)]  # 3x --max-num-seqs at 20 tok/s
    threads = [
        threading.Thread(
            target=stream_completion, args=(api, "hog", 1000), kwargs={"stream": h}, daemon=True
        )
        for h in hogs
    ]
    for t in threads:
        t.start()
    time.sleep(2.0)
    busy = statistics.median(ttft("newcomer") for _ in range(3))
    for h in hogs:
        h.close()
    for t in threads:
        t.join(timeout=30)
    ratio = busy / solo
    print(
        f"newcomer time to first token: alone {solo * 1000:.0f} ms, beside 48 throttled "
        f"streams {busy * 1000:.0f} ms (ratio {ratio:.1f})"
    )
    # Measured here: 9 ms alone and 9 ms beside the hogs. A newcomer that has
    # to wait for a hog's stream to end would wait minutes; one that waits
    # for a wake-up cycle or a burst, 100 ms or more.
    assert busy <= 2 * solo + 0.1


def test_editing_the_policy_changes_a_running_users_rate(server):
    path: Path = server.policy_path
    long_run = Stream("edit-me", 1000)
    worker = threading.Thread(
        target=stream_completion,
        args=(client(server.base_url), "edit-me", 1000),
        kwargs={"stream": long_run},
        daemon=True,
    )
    worker.start()
    try:
        time.sleep(2.0)
        edited_at = time.monotonic_ns()
        offset = Path(server.log_path).stat().st_size
        path.write_text(POLICY.replace("edit-me: 20", "edit-me: 60"))
        applied_at = wait_reloaded(server, offset)
        swapped_at = wait_swapped(server, edited_at)
        time.sleep(2.5)
        broken_at = time.monotonic_ns()
        path.write_text(POLICY.replace("edit-me: 20", "edit-me: [60"))  # broken edit
        time.sleep(2.0)
        api = client(server.base_url)
        answer = api.completions.create(
            model="tiny", prompt="still there?", max_tokens=4, extra_body={"ignore_eos": True}
        )  # the tiny model samples its end-of-text token now and then
        long_run.close()
        worker.join(timeout=30)
        assert answer.usage.completion_tokens == 4
        lines = trace_steps(server, edited_at - 2 * S_NS)
        steps = engine_steps(server, "edit-me")

        def rate(a: int, b: int, limit: int = 60) -> tuple[float, float]:
            """edit-me's tok/s from a to b, and what one stream running at
            `limit` could get then: what an exact GCRA limiter grants it at
            the steps the engine ran, a token a step, its bucket drained at
            a (a stall past the burst loses what is past it: in one fresh
            run, 54 tok/s at 98 steps/s, and 0.95 x 60 asked)."""
            tokens = sum(k for t, k in steps if a <= t < b)
            times = [r["t"] for r in lines if a <= r["t"] < b]
            allowed = gcra_allowed(times, limit, BURST_NS, 1, drained=True)
            return tokens / ((b - a) / S_NS), allowed / ((b - a) / S_NS)

        before, _ = rate(edited_at - 15 * S_NS // 10, edited_at, 20)
        # From a quarter second after the scheduler swapped (the file is
        # watched; under load neither the reload nor the swap is instant).
        after_edit, cap_edit = rate(swapped_at + S_NS // 4, broken_at)
        after_broken, cap_broken = rate(broken_at + S_NS // 2, broken_at + 2 * S_NS)
        print(
            f"edit-me (engine): {before:.1f} tok/s, after the edit {after_edit:.1f} (its steps "
            f"allowed {cap_edit:.0f}), after a broken edit {after_broken:.1f} ({cap_broken:.0f}); "
            f"the reload logged {(applied_at - edited_at) / 1e6:.0f} ms after the write, the "
            f"scheduler swapped at {(swapped_at - edited_at) / 1e6:.0f} ms"
        )
        assert swapped_at - edited_at <= 2 * S_NS  # the edit applies within seconds
        assert before <= 20 * 1.1
        assert after_edit >= 0.95 * cap_edit
        assert after_broken >= 0.95 * cap_broken
        log = Path(server.log_path).read_text()
        assert "edit-me 20 -> 60 tok/s" in log
        assert "reload rejected, keeping the last good policy" in log
    finally:
        path.write_text(POLICY)  # the next tests share this server and its policy
