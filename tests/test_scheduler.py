"""Charging semantics on the real vLLM Scheduler and AsyncScheduler.

Real scheduler, real KV cache manager, real Request objects; fake clock and
fabricated model outputs (see vllm_harness)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm_harness import (  # noqa: E402
    MS,
    Driver,
    FakeClock,
    S,
    make_request,
    make_scheduler,
    user_times,
)

from outrate.identity.core import ANONYMOUS  # noqa: E402
from outrate.policy.compiler import compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402
from outrate.policy.pipeline import policy_from_flags  # noqa: E402

pytestmark = pytest.mark.vllm
KINDS = ["sync", "async"]


def policy(text: str):
    return compile_policy(parse_policy(text, "test.yaml"), "test.yaml")


def remaining(sched, user: str) -> int:
    return sched.limiter.stats(user, sched._clock()).remaining


@pytest.mark.parametrize("kind", KINDS)
def test_middle_prefill_chunks_are_free_and_the_last_chunk_is_charged(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy_from_flags(None, {"a": 1}), clock, max_num_batched_tokens=32)
    d = Driver(s, clock, step_ns=0)
    req = d.add(make_request("a", prompt_len=100, max_tokens=4))
    assert remaining(s, "a") == 1
    for _ in range(3):  # chunks of 32, 32, 32: no sampling yet
        out = d.step()
        assert out.num_scheduled_tokens[req.request_id] == 32
        assert remaining(s, "a") == 1
        assert s.charged == 0
    out = d.step()  # last 4 prompt tokens: samples the first token
    assert out.num_scheduled_tokens[req.request_id] == 4
    assert s.charged == 1
    assert remaining(s, "a") == 0


@pytest.mark.parametrize("kind", KINDS)
def test_every_sampled_dispatch_is_charged_once(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy_from_flags(None, {"a": 1000}), clock)
    d = Driver(s, clock, step_ns=10 * MS)
    reqs = [d.add(make_request("a", max_tokens=30)) for _ in range(3)]
    d.run_until_done()
    d.drain()
    assert all(d.emitted[r.request_id] == 30 for r in reqs)
    # Sync: one charge per token. Async: the same (max_tokens stops are known
    # at dispatch, so no look-ahead step is dispatched past them).
    assert s.charged == 90
    assert s.metrics.refunded == 0


def test_async_look_ahead_after_a_stop_token_is_the_only_over_charge():
    clock = FakeClock()
    s = make_scheduler("async", policy_from_flags(None, {"a": 1000}), clock)
    d = Driver(s, clock)
    sp = SamplingParams(max_tokens=50, stop_token_ids=[7])  # the fake model always samples 7
    req = Request("stop-me", [5, 6, 8, 9], sp, None, block_hasher=None)
    d.user_of[req.request_id] = ANONYMOUS
    s.add_request(req)
    d.run_until_done()
    d.drain()
    assert d.emitted["stop-me"] == 1
    assert s.charged - d.emitted["stop-me"] <= 1


def test_async_stop_over_charge_is_the_placeholders_left_at_free(monkeypatch):
    """vLLM 0.33 moved `_update_request_with_output` (and its placeholder
    count) from AsyncScheduler into Scheduler. On both versions: a dispatched
    async decode holds one placeholder; a stop leaves the look-ahead's
    placeholder when the request is freed, and that is exactly the over-charge."""
    clock = FakeClock()
    s = make_scheduler("async", policy_from_flags(None, {"a": 1000}), clock)
    d = Driver(s, clock)
    seen: dict[str, int] = {}
    stock_free = s._free_request

    def free(request, *a, **kw):
        seen[request.request_id] = request.num_output_placeholders
        return stock_free(request, *a, **kw)

    monkeypatch.setattr(s, "_free_request", free)
    sp = SamplingParams(max_tokens=50, stop_token_ids=[7])  # the fake model always samples 7
    req = Request("stop-me", [5, 6, 8, 9], sp, None, block_hasher=None)
    d.user_of[req.request_id] = ANONYMOUS
    s.add_request(req)
    d.step()
    assert req.num_output_placeholders == 1  # dispatched, not yet returned
    d.run_until_done()
    d.drain()
    assert d.emitted["stop-me"] == 1
    assert seen["stop-me"] == s.charged - d.emitted["stop-me"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_update_from_output_never_touches_the_limiter(kind, monkeypatch):
    clock = FakeClock()
    s = make_scheduler(kind, policy_from_flags(None, {"a": 20}), clock)
    d = Driver(s, clock)
    for _ in range(3):
        d.add(make_request("a", max_tokens=20))
    inside = {"update": False}
    stock_update = s.update_from_output

    def update(*a, **kw):
        inside["update"] = True
        try:
            return stock_update(*a, **kw)
        finally:
            inside["update"] = False

    monkeypatch.setattr(s, "update_from_output", update)
    for verb in ("take", "take_upto", "give_back", "ready_at", "available", "set_policy"):
        stock = getattr(s.limiter, verb)

        def guarded(*a, _stock=stock, _verb=verb, **kw):
            assert not inside["update"], f"update_from_output called limiter.{_verb}"
            return _stock(*a, **kw)

        monkeypatch.setattr(s.limiter, verb, guarded)
    d.run(200)
    assert d.tokens_of("a") > 0


@pytest.mark.parametrize("kind", KINDS)
def test_kv_allocation_failure_refunds_the_charge(kind):
    clock = FakeClock()
    # 8 blocks of 16 tokens (one is vLLM's null block): the first prompt takes 6.
    s = make_scheduler(kind, policy_from_flags(None, {"b": 1}), clock, num_blocks=8)
    d = Driver(s, clock, step_ns=0)
    big = d.add(make_request("a", prompt_len=90, max_tokens=2))
    small = d.add(make_request("b", prompt_len=40, max_tokens=2))
    out = d.step()
    assert big.request_id in out.num_scheduled_tokens
    assert small.request_id not in out.num_scheduled_tokens
    assert s.metrics.refunded >= 1
    assert remaining(s, "b") == 1  # the charge for b was given back
    d.step_ns = 100 * MS
    d.run_until_done()
    assert d.emitted[small.request_id] == 2


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_budget_prefill_runs_to_the_second_to_last_position(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy_from_flags(None, {"a": 1}), clock)
    d = Driver(s, clock, step_ns=0)
    first = d.add(make_request("a", prompt_len=8, max_tokens=1))
    d.step()
    d.drain()
    assert remaining(s, "a") == 0
    second = d.add(make_request("a", prompt_len=41, max_tokens=1))
    out = d.step()
    assert out.num_scheduled_tokens[second.request_id] == 40  # all but the sampling position
    assert second.num_computed_tokens == 40
    for _ in range(3):
        out = d.step()
        assert second.request_id not in out.num_scheduled_tokens  # waits for budget
    d.drain()
    assert d.emitted.get(second.request_id, 0) == 0
    clock.advance(1 * S)
    out = d.step()
    assert out.num_scheduled_tokens[second.request_id] == 1
    d.drain()
    assert d.emitted[first.request_id] == 1
    assert d.emitted[second.request_id] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_without_chunked_prefill_the_prompt_waits_and_others_are_admitted(kind):
    clock = FakeClock()
    s = make_scheduler(
        kind, policy_from_flags(None, {"a": 1}), clock, chunked=False, max_num_batched_tokens=2048
    )
    d = Driver(s, clock, step_ns=0)
    d.add(make_request("a", prompt_len=8, max_tokens=1))
    d.step()
    d.drain()
    blocked = d.add(make_request("a", prompt_len=40, max_tokens=1))
    other = d.add(make_request("c", prompt_len=40, max_tokens=3))
    out = d.step()
    assert blocked.request_id not in out.num_scheduled_tokens
    assert blocked.num_computed_tokens == 0
    assert out.num_scheduled_tokens[other.request_id] == 40  # not stalled behind a
    for _ in range(4):
        d.step()
    d.drain()
    assert d.emitted[other.request_id] == 3
    assert d.emitted.get(blocked.request_id, 0) == 0
    clock.advance(1 * S)
    d.run_until_done()
    assert d.emitted[blocked.request_id] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_fully_cached_prompt_of_a_throttled_user_never_stalls_admission(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy_from_flags(None, {"a": 1}), clock)
    d = Driver(s, clock, step_ns=0)
    prompt = list(range(3, 36))  # 33 tokens: (33 - 1) is a multiple of the block size
    d.add(make_request("a", prompt=prompt, max_tokens=1))
    d.run(3)
    d.drain()
    again = d.add(make_request("a", prompt=prompt, max_tokens=1))  # 32 tokens cached
    other = d.add(make_request("c", prompt_len=8, max_tokens=1))
    out = d.step()
    assert again.request_id not in out.num_scheduled_tokens
    assert other.request_id in out.num_scheduled_tokens


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("streams", [1, 4])
def test_gcra_bound_and_rate_on_the_real_scheduler(kind, streams):
    clock = FakeClock()
    s = make_scheduler(kind, policy_from_flags(None, {"a": 20, "b": 100}), clock)
    d = Driver(s, clock, step_ns=5 * MS)
    for _ in range(streams):
        d.add(make_request("a", max_tokens=10_000))
    d.add(make_request("b", max_tokens=10_000))
    d.add(make_request("free", max_tokens=10_000))
    duration = 6 * S
    d.run(duration // d.step_ns)
    burst_ns = 100 * MS
    for user, rate in (("a", 20), ("b", 100)):
        times = user_times(d.timeline, user)
        # Every window [t_i, t_j] of delivered tokens obeys the GCRA bound
        # (W + burst) * rate + 1, in exact integer arithmetic.
        for i in range(len(times)):
            for j in range(i, min(len(times), i + rate * 2)):
                window_ns = times[j] - times[i]
                assert (j - i) * S <= (window_ns + burst_ns) * rate, (user, i, j)
        assert len(times) >= 0.95 * rate * duration / S
    assert d.tokens_of("free") >= 0.9 * duration // d.step_ns  # unlimited: one per step


@pytest.mark.parametrize("kind", KINDS)
def test_streams_of_one_user_rotate(kind):
    clock = FakeClock()
    s = make_scheduler(kind, policy_from_flags(None, {"a": 20}), clock)
    d = Driver(s, clock, step_ns=10 * MS)
    reqs = [d.add(make_request("a", max_tokens=10_000)) for _ in range(4)]
    d.run(400)  # 4 s: about 80 tokens
    counts = [d.emitted.get(r.request_id, 0) for r in reqs]
    assert sum(counts) >= 76
    assert max(counts) - min(counts) <= 2, counts


@pytest.mark.parametrize("kind", KINDS)
def test_requests_without_identity_share_the_anonymous_budget(kind):
    clock = FakeClock()
    pol = policy("version: 1\ndefault: unlimited\nanonymous: 10\n")
    s = make_scheduler(kind, pol, clock)
    d = Driver(s, clock, step_ns=10 * MS)
    for _ in range(3):
        d.add(make_request(None, max_tokens=10_000))
    d.add(make_request("named", max_tokens=10_000))
    d.run(300)
    assert 28 <= d.tokens_of(ANONYMOUS) <= 32
    assert d.tokens_of("named") >= 290


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [5, "", "x" * 300, "a\nb", ["a"], ANONYMOUS])
def test_an_invalid_identity_in_the_engine_counts_as_anonymous(kind, bad):
    clock = FakeClock()
    pol = policy("version: 1\ndefault: unlimited\nanonymous: 10\n")
    s = make_scheduler(kind, pol, clock)
    d = Driver(s, clock, step_ns=10 * MS)
    req = make_request(None, max_tokens=10_000, xargs={"output_rate_user": bad})
    d.add(req)
    d.user_of[req.request_id] = ANONYMOUS
    d.run(100)
    assert 9 <= d.tokens_of(ANONYMOUS) <= 12


@pytest.mark.parametrize("kind", KINDS)
def test_policy_swap_applies_at_the_next_step(kind):
    clock = FakeClock()
    box_policy = policy_from_flags(None, {"a": 1})
    s = make_scheduler(kind, box_policy, clock)
    d = Driver(s, clock, step_ns=10 * MS)
    d.add(make_request("a", max_tokens=10_000))
    d.run(100)
    slow = d.tokens_of("a")
    assert slow <= 3
    s.policy_box.current = policy_from_flags(None, {"a": 50})
    d.run(100)
    assert 45 <= d.tokens_of("a") - slow <= (1 + 0.1) * 50 + 1


def test_a_prefill_lookahead_is_refused_not_skipped():
    """The charging hook replaces stock's `_reserve_prefill_lookahead`, whose
    body only multi-module MTP speculative decoding needs: a scheduler with
    that lookahead refuses to start rather than silently drop it."""
    s = make_scheduler("sync", policy_from_flags(None, {}))
    s.num_prefill_lookahead = 2
    with pytest.raises(ValueError, match="speculative decoding"):
        s.outrate_configure(policy_from_flags(None, {}))


@pytest.mark.parametrize("kind", KINDS)
def test_unlimited_policy_schedules_exactly_like_stock(kind):
    """Same workload, same decisions, step by step, as vLLM's own scheduler."""
    rng = random.Random(7)
    workload = [
        (rng.randrange(0, 40), rng.randrange(1, 120), rng.randrange(1, 40), f"u{rng.randrange(4)}")
        for _ in range(60)
    ]
    runs = []
    for sched_kind in (kind, f"stock-{kind}"):
        s = make_scheduler(
            sched_kind,
            policy("version: 1\ndefault: unlimited\n"),
            FakeClock(),
            num_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=96,
        )
        d = Driver(s)
        decisions = []
        for step in range(400):
            for i, (at, plen, mtok, user) in enumerate(workload):
                if at == step:
                    d.add(
                        make_request(
                            user,
                            prompt=[(i * 7 + k) % 400 + 3 for k in range(plen)],
                            max_tokens=mtok,
                            req_id=f"w{i}",
                        )
                    )
            out = d.step()
            decisions.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids)))
        d.drain()
        runs.append((decisions, dict(d.emitted)))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kind", KINDS)
def test_without_a_body_source_the_engine_never_trusts_a_body_claim(kind):
    """identity.source header (or api_key): only the API server's signature
    names the user; a claim in extra_args (what vllm_xargs become) is ignored,
    and so is a signature made with another secret. A reload to body trusts
    claims again from the next request on."""
    from outrate.identity.core import STAMP_KEY, Stamper
    from vllm_integration.step.state import ATTR

    text = "version: 1\ndefault: 100\nidentity: {source: header, header: x-user}\n"
    s = make_scheduler(kind, policy(text), FakeClock())
    s._stamper = Stamper(b"e" * 32)
    stamp = s._stamper.sign("alice")
    signed = make_request(None, xargs={STAMP_KEY: stamp, "output_rate_user": "x"})
    spoofed = make_request("bob")
    forged = make_request(None, xargs={STAMP_KEY: Stamper(b"f" * 32).sign("bob")})
    for req in (signed, spoofed, forged):
        s.add_request(req)
    assert [r.__dict__[ATTR].user.key for r in (signed, spoofed, forged)] == [
        "alice", ANONYMOUS, ANONYMOUS,
    ]  # fmt: skip
    s.policy_box.current = policy("version: 1\ndefault: 100\n")
    claimed = make_request("bob")
    s.add_request(claimed)
    assert claimed.__dict__[ATTR].user.key == "bob"
