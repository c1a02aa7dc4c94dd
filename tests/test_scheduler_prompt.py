"""Prompt limits on the real vLLM Scheduler and AsyncScheduler (issue 40,
docs/prompt-limits.md): what is charged, the per-step cap, refunds, and that a
user out of prompt budget holds nobody back. Real scheduler and KV cache
manager; fake clock and fabricated outputs (vllm_harness)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_harness import MS, Driver, FakeClock, S, make_request, make_scheduler  # noqa: E402

from outrate.observe.publish import snapshot  # noqa: E402
from outrate.observe.trace import TraceWriter, read_trace  # noqa: E402
from outrate.policy.compiler import compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402

pytestmark = pytest.mark.vllm
KINDS = ["sync", "async"]


def policy(users: str):
    text = f"version: 1\ndefault: unlimited\nusers:\n{users}"
    return compile_policy(parse_policy(text, "test.yaml"), "test.yaml")


def prompt_of(sched, user: str) -> int:
    return sched.metrics.labels[user].prompt


@pytest.mark.parametrize("kind", KINDS)
def test_computed_prompt_tokens_are_charged_chunk_by_chunk(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, prompt: 100000}\n"), clock,
                       max_num_batched_tokens=32)  # fmt: skip
    d = Driver(s, clock, step_ns=10 * MS)
    d.add(make_request("a", prompt_len=100, max_tokens=2))
    seen = []
    for _ in range(4):
        d.step()
        seen.append(prompt_of(s, "a"))
    assert seen == [32, 64, 96, 100]
    d.run_until_done()
    assert prompt_of(s, "a") == 100  # decodes charge no prompt


@pytest.mark.parametrize("kind", KINDS)
def test_the_trace_records_prompt_tokens_net_of_refunds(kind, tmp_path):
    """A prompt charged and refunded while its KV does not fit (each step
    until b finishes) appears in the trace once, when it is computed: the
    trace's sum is the net counter, not the gross charges."""
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, prompt: 100000}\n  b: 100\n"), clock,
                       num_blocks=12)  # fmt: skip
    trace = TraceWriter(str(tmp_path / "t.jsonl"))
    s.outrate_trace(trace)
    d = Driver(s, clock, step_ns=10 * MS)
    d.add(make_request("b", prompt_len=150, max_tokens=10))  # 10 of the 11 usable blocks
    d.step()
    big = d.add(make_request("a", prompt_len=100, max_tokens=1))  # fits once b is done
    d.run_until_done()
    trace.stop()
    assert big.request_id in d.finished and s.metrics.prompt_refunded >= 100
    lines = read_trace(tmp_path / "t.jsonl")
    assert [r["prompt"]["a"] for r in lines if "a" in r.get("prompt", {})] == [100]
    assert prompt_of(s, "a") == 100
    # b has no prompt limit: counted (while some rule limits prompts), never cut
    assert [r["prompt"]["b"] for r in lines if "b" in r.get("prompt", {})] == [150]


@pytest.mark.parametrize("kind", KINDS)
def test_the_trace_records_each_chunks_prompt_tokens(kind, tmp_path):
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, prompt: 100000}\n"), clock,
                       max_num_batched_tokens=32)  # fmt: skip
    trace = TraceWriter(str(tmp_path / "t.jsonl"))
    s.outrate_trace(trace)
    d = Driver(s, clock, step_ns=10 * MS)
    d.add(make_request("a", prompt_len=100, max_tokens=3))
    d.run_until_done()
    trace.stop()
    lines = read_trace(tmp_path / "t.jsonl")
    assert [r["prompt"]["a"] for r in lines if "prompt" in r] == [32, 32, 32, 4]
    assert [r["step"] for r in lines if "prompt" in r] == [1, 2, 3, 4]  # no output charged in 1-3
    row = snapshot(s.metrics, s._policy, now=clock.now)["labels"]["a"]
    assert (row["prompt"], row["prompt_rate"]) == (100, 100000)  # what /metrics shows


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_hits_are_free(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, prompt: 100000}\n"), clock)
    d = Driver(s, clock, step_ns=10 * MS)
    prompt = list(range(3, 36))  # 33 tokens: two full blocks can hit
    d.add(make_request("a", prompt=prompt, max_tokens=1))
    d.run_until_done()
    assert prompt_of(s, "a") == 33
    d.add(make_request("a", prompt=prompt, max_tokens=1))
    d.run_until_done()
    assert prompt_of(s, "a") == 33 + 1  # 32 hit, the last position computed


@pytest.mark.parametrize("kind", KINDS)
def test_a_chunk_is_at_most_the_prompt_budget_and_long_prompts_finish(kind):
    """rate 1000/s, burst 100 ms: at most 101 tokens at once, then ~10 per
    10 ms step; every window obeys (W + burst) * rate + 1. A 600-token
    prompt, 6x the burst, is computed over time, never refused."""
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, prompt: 1000}\n"), clock)
    d = Driver(s, clock, step_ns=10 * MS)
    req = d.add(make_request("a", prompt_len=600, max_tokens=1))
    per_step = []
    while req.request_id not in d.finished and d.steps < 500:
        before = prompt_of(s, "a")
        t = clock.now
        out = d.step()
        n = prompt_of(s, "a") - before
        assert out.num_scheduled_tokens.get(req.request_id, 0) >= n
        per_step.append((t, n))
    d.drain()
    assert req.request_id in d.finished and prompt_of(s, "a") == 600
    assert per_step[0][1] == 101
    for i in range(len(per_step)):
        total = 0
        for j in range(i, len(per_step)):
            total += per_step[j][1]
            window = per_step[j][0] - per_step[i][0]
            assert (total - 1) * S <= (window + 100 * MS) * 1000, (i, j)
    took = per_step[-1][0] - per_step[0][0]
    assert 0.45 * S <= took <= 0.55 * S  # (600 - 101) / 1000 s


@pytest.mark.parametrize("kind", KINDS)
def test_a_user_out_of_prompt_budget_holds_nobody_back(kind):
    """mallory's prompts wait for prompt budget; bob's requests behind hers
    in the queue are admitted, and bob decodes every step. Her running
    prefills skipped for budget take no active seat."""
    clock = FakeClock()
    s = make_scheduler(
        kind,
        policy("  mallory: {rate: 20, prompt: 200}\n  bob: 1000\n"),
        clock,
        max_num_seqs=8,
        max_num_active_seqs=4,
    )
    d = Driver(s, clock, step_ns=10 * MS)
    mal = [d.add(make_request("mallory", prompt_len=1000, max_tokens=1)) for _ in range(6)]
    bobs = [d.add(make_request("bob", prompt_len=8, max_tokens=50)) for _ in range(2)]
    d.run(3)
    for _ in range(20):
        out = d.step()
        for b in bobs:
            assert out.num_scheduled_tokens.get(b.request_id) == 1  # a decode every step
    assert s.metrics.deferred["prompt"] >= 1
    assert sum(r.num_computed_tokens for r in mal) <= 21 + 200 * 0.23 + 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_kv_allocation_failure_refunds_the_prompt_charge(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, prompt: 100000}\n  b: 100\n"), clock,
                       num_blocks=12)  # fmt: skip
    d = Driver(s, clock, step_ns=10 * MS)
    d.add(make_request("b", prompt_len=150, max_tokens=40))
    d.step()
    big = d.add(make_request("a", prompt_len=100, max_tokens=1))  # fits no free blocks
    out = d.step()
    assert big.request_id not in out.num_scheduled_tokens
    assert s.metrics.labels["a"].prompt == 0
    assert s.metrics.prompt_refunded >= 100  # charged at dispatch, given back
    assert s.prompt_table.stats("a", clock.now).remaining == 10001  # the whole burst back


@pytest.mark.parametrize("kind", KINDS)
def test_without_prompt_limits_nothing_is_counted_or_paced(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: 100\n"), clock, max_num_batched_tokens=32)
    d = Driver(s, clock, step_ns=10 * MS)
    req = d.add(make_request("a", prompt_len=100, max_tokens=1))
    out = d.step()
    assert out.num_scheduled_tokens[req.request_id] == 32
    assert s.metrics.labels["a"].prompt == 0 and not s._prompts


SHARED = (
    "test.yaml:5:25: users.b.prompt: with --outrate-store and chunked prefill off, a "
    "prompt limit cannot be kept: a prompt is then computed whole, but an engine holds a "
    "shared budget's credit one lease slice at a time (rate x lease horizon, "
    "docs/several-engines.md), so a prompt longer than the slice would wait forever; "
    "enable chunked prefill, or remove 'prompt' from: users.b"
)


def test_a_shared_store_refuses_prompt_limits_only_without_chunked_prefill():
    """OR119, the engine's side (start and reload): lint's message, located.
    With chunked prefill a prompt limit is shared through the store (issue 40
    item 7); without it a whole prompt would wait for more credit than an
    engine ever holds. (max_model_len 51: the burst holds it, so OR118 is quiet.)"""
    from outrate.errors import PolicyError
    from vllm_integration.common.config import refuse_prompt_limits

    refuse_prompt_limits(policy("  a: 100\n"), True, False, 51)  # no prompt limit: fine
    limited = policy("  a: 100\n  b: {rate: 20, prompt: 500}\n")
    refuse_prompt_limits(limited, False, False, 51)  # no store: fine
    refuse_prompt_limits(limited, True, True, 2048)  # shared, chunked: fine
    refuse_prompt_limits(limited, True, None, 2048)  # chunked prefill unknown: vLLM's default
    with pytest.raises(PolicyError) as info:
        refuse_prompt_limits(limited, True, False, 51)
    assert str(info.value) == SHARED


def test_without_chunked_prefill_a_prompt_burst_below_the_longest_prompt_is_refused():
    """OR118, the engine's side: a whole prompt waits for a bucket that holds
    all of it, so a bucket smaller than max_model_len would be a refusal in
    all but name. 500/s at the policy's 100 ms holds 51 tokens; 3000/s for
    1 s holds 3001; shadow limits are never enforced."""
    from outrate.errors import PolicyError
    from vllm_integration.common.config import refuse_prompt_limits

    short = policy("  a: 100\n  b: {rate: 20, prompt: 500}\n")
    refuse_prompt_limits(short, False, True, 2048)  # chunked prefill: fine
    with pytest.raises(PolicyError) as info:
        refuse_prompt_limits(short, False, False, 2048)
    assert str(info.value) == (
        "test.yaml:5:25: users.b.prompt: without chunked prefill a prompt is computed "
        "whole, so a prompt limit must hold the longest prompt (max_model_len 2048 tokens), "
        "but its burst holds 51 (rate x burst + 1): such prompts would wait forever; enable "
        "chunked prefill, or raise the prompt's rate or burst, in: users.b"
    )
    refuse_prompt_limits(short, False, False, 51)  # holds the longest prompt
    for fits in ("{rate: 3000, burst: 1s}", "500\n    shadow: true"):
        refuse_prompt_limits(
            policy(f"  b:\n    rate: 20\n    prompt: {fits}\n"), False, False, 2048
        )


def test_a_reload_the_engine_cannot_enforce_is_rejected_and_the_old_policy_kept(tmp_path):
    """Without chunked prefill the engine core's reloader rejects a prompt
    limit below max_model_len (OR118), located, and keeps serving the old
    policy; a prompt limit that holds it applies."""
    from outrate.policy.pipeline import load_compiled
    from vllm_integration.common.settings import EngineSettings
    from vllm_integration.enginecore.threads import start_engine_threads

    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\ndefault: 100\n")
    clock = FakeClock()
    s = make_scheduler("sync", load_compiled(path), clock, chunked=False,
                       max_num_batched_tokens=2048)  # fmt: skip
    threads = start_engine_threads(s, EngineSettings(policy=str(path), reload="poll"))
    try:
        assert threads.reloader is not None
        old = s.policy_box.current
        path.write_text("version: 1\ndefault: {rate: 100, prompt: 500}\n")
        assert threads.reloader.wait_rejected(1, timeout=5)
        assert s.policy_box.current is old
        path.write_text("version: 1\ndefault: {rate: 100, prompt: {rate: 4000, burst: 1s}}\n")
        assert threads.reloader.wait_applied(1, timeout=5)
        assert s.policy_box.current.default.prompt is not None
    finally:
        threads.stop()


def _traced(s, tmp_path):
    trace = TraceWriter(str(tmp_path / "t.jsonl"))
    s.outrate_trace(trace)
    return trace


def _per_step(lines, key: str, user: str) -> list[tuple[int, int]]:
    return [(r["step"], r[key][user]) for r in lines if user in r.get(key, {})]


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_deferred_for_prompt_budget_waits_until_admitted(kind, tmp_path):
    """prompt 1000/s, burst 100 ms (101 tokens): the first 300-token prompt
    takes the burst, then the budget as it returns; the second is deferred
    from step 1 until the first's prompt is done. One wait, counted once on
    the limit (`outrate_prompt_waits_total`), the gauge 1 while it lasts
    and 0 after; the trace counts it in every step it waited."""
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, prompt: 1000}\n"), clock)
    trace = _traced(s, tmp_path)
    d = Driver(s, clock, step_ns=10 * MS)
    d.add(make_request("a", prompt_len=300, max_tokens=1))
    second = d.add(make_request("a", prompt_len=300, max_tokens=1))
    m = s.metrics.labels["a"]
    d.step()
    assert (m.prompt_waiting, m.prompt_waits, s.metrics.deferred["prompt"]) == (1, 1, 1)
    while second.num_computed_tokens == 0 and d.steps < 100:
        assert (m.prompt_waiting, m.prompt_waits) == (1, 1)
        d.step()
    assert (m.prompt_waiting, m.prompt_waits) == (0, 1)
    d.run_until_done()
    trace.stop()
    assert (m.prompt_waiting, m.prompt_waits, s.metrics.deferred["prompt"]) == (0, 1, 1)
    waited = _per_step(read_trace(tmp_path / "t.jsonl"), "prompt_waiting", "a")
    assert len(waited) >= 15  # (300 - 101) / 1000 s in 10 ms steps, give or take
    assert waited == [(k, 1) for k in range(1, len(waited) + 1)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_running_prefill_skipped_for_prompt_budget_waits_until_charged(kind, tmp_path):
    """prompt 50/s (a token every 20 ms) in 10 ms steps: after the burst the
    running prefill gets a token every other step and waits in between.
    Each skip starts a wait, each token ends it; a reload that drops the
    prompt limit ends a wait at once."""
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, prompt: 50}\n"), clock)
    trace = _traced(s, tmp_path)
    d = Driver(s, clock, step_ns=10 * MS)
    req = d.add(make_request("a", prompt_len=100, max_tokens=1))
    m = s.metrics.labels["a"]
    gauge = []
    for _ in range(8):
        d.step()
        gauge.append(m.prompt_waiting)
    trace.stop()
    assert req.num_computed_tokens < 100 and s.metrics.prompt_skips == m.prompt_waits
    assert set(gauge) == {0, 1} and m.prompt_waits == sum(gauge) >= 3
    waited = _per_step(read_trace(tmp_path / "t.jsonl"), "prompt_waiting", "a")
    assert [k for k, _ in waited] == [i + 1 for i, w in enumerate(gauge) if w]
    while not m.prompt_waiting:
        d.step()
    s.policy_box.current = policy("  a: 100\n")  # prompts unlimited again
    d.step()
    assert m.prompt_waiting == 0 and s.metrics.labels["a"].prompt_waiting == 0
    d.run_until_done()
    assert req.request_id in d.finished and m.prompt_waiting == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_shadow_prompt_limit_counts_what_it_would_hold_and_paces_nothing(kind, tmp_path):
    """`shadow: true` with `prompt: 1000` (burst 101 tokens): the prompt runs
    as stock runs it (one 512-token chunk, the step's budget), nobody waits,
    and the tokens beyond the prompt budget are counted
    (`outrate_prompt_shadow_over_tokens_total`, the trace's `prompt_over`):
    600 computed, 101 + 10 within the budget over the two steps."""
    clock = FakeClock()
    s = make_scheduler(kind, policy("  a: {rate: 100, shadow: true, prompt: 1000}\n"), clock)
    trace = _traced(s, tmp_path)
    d = Driver(s, clock, step_ns=10 * MS)
    req = d.add(make_request("a", prompt_len=600, max_tokens=2))
    out = d.step()
    assert out.num_scheduled_tokens[req.request_id] == 512  # stock's chunk, not the budget
    d.run_until_done()
    trace.stop()
    m = s.metrics.labels["a"]
    assert (m.prompt, m.prompt_over) == (600, 600 - 101 - 10)
    assert (m.prompt_waiting, m.prompt_waits, s.metrics.deferred["prompt"]) == (0, 0, 0)
    lines = read_trace(tmp_path / "t.jsonl")
    assert _per_step(lines, "prompt", "a") == [(1, 512), (2, 88)]
    assert _per_step(lines, "prompt_over", "a") == [(1, 512 - 101), (2, 88 - 10)]
    assert not _per_step(lines, "prompt_waiting", "a")
    row = snapshot(s.metrics, s._policy, now=clock.now)["labels"]["a"]
    assert (row["prompt_over"], row["mode"]) == (489, "shadow")


@pytest.mark.parametrize("kind", KINDS)
def test_a_refund_takes_back_the_shadow_prompt_over_count(kind, tmp_path):
    """A shadow-limited prompt charged while its KV does not fit (each step
    until b finishes) is counted over its limit only in the step that
    computes it: the counter equals the trace's sum, net of refunds."""
    clock = FakeClock()
    users = "  a: {rate: 100, shadow: true, prompt: 50}\n  b: 100\n"
    s = make_scheduler(kind, policy(users), clock, num_blocks=12)
    trace = _traced(s, tmp_path)
    d = Driver(s, clock, step_ns=10 * MS)
    d.add(make_request("b", prompt_len=150, max_tokens=10))
    d.step()
    big = d.add(make_request("a", prompt_len=100, max_tokens=1))
    out = d.step()
    assert big.request_id not in out.num_scheduled_tokens
    m = s.metrics.labels["a"]
    assert (m.prompt, m.prompt_over) == (0, 0)  # charged and refunded
    d.run_until_done()
    trace.stop()
    over = _per_step(read_trace(tmp_path / "t.jsonl"), "prompt_over", "a")
    assert len(over) == 1 and m.prompt == 100 and m.prompt_over == over[0][1] > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("limited", [True, False], ids=["prompt-limits", "none"])
def test_decodes_never_wait_behind_a_prefill_whatever_the_running_order(kind, limited):
    """A 64-token step budget; bob's 8 requests decoding, and a's 1,000-token
    prompt put first in `running` (stock serves `running` in order, so its
    chunk would take the whole budget). Under prompt limits the chunk leaves
    every other running request a token: all 8 decode in every step, and
    the prompt still advances. Without any prompt limit outrate leaves
    stock's order alone, and the decodes wait (what the reserve is for)."""
    a = "{rate: 100, prompt: 100000}" if limited else "100"
    clock = FakeClock()
    s = make_scheduler(kind, policy(f"  a: {a}\n  b: 1000\n"), clock, max_num_batched_tokens=64)
    d = Driver(s, clock, step_ns=10 * MS)
    bobs = [d.add(make_request("b", prompt_len=4, max_tokens=200)) for _ in range(8)]
    for _ in range(3):
        d.step()
    big = d.add(make_request("a", prompt_len=1000, max_tokens=1))
    d.step()  # admitted: last in `running`
    s.running.remove(big)
    s.running.insert(0, big)
    decoded, chunks = [], []
    while big.num_computed_tokens < 1000 and len(chunks) < 100:
        out = d.step()
        decoded.append(sum(1 for r in bobs if r.request_id in out.num_scheduled_tokens))
        chunks.append(out.num_scheduled_tokens.get(big.request_id, 0))
    if limited:
        assert decoded == [8] * len(decoded)
        assert chunks[:-1] == [64 - 8] * (len(chunks) - 1)  # the rest of the budget, each step
    else:
        assert min(decoded) == 0 and max(chunks) == 64
