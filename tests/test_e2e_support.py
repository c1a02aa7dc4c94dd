"""The judge of pacing that tests/e2e_support.py and benchmarks/gpu_check.py
share: `outrate.observe.trace.gcra_allowed`, what an exact GCRA limiter grants
at the step times an engine recorded (no server here)."""

from __future__ import annotations

from outrate.observe.trace import gcra_allowed, steps_allowed_rate

MS = 1_000_000


def test_even_steps_give_the_limit_and_the_burst() -> None:
    times = [i * MS for i in range(1001)]  # 1 s of 1 ms steps
    assert gcra_allowed(times, 100, 100 * MS, 1) == 100 + 11  # 1 s at 100 tok/s, then the burst


def test_a_stall_past_the_burst_loses_the_tokens_past_it() -> None:
    even = [i * MS for i in range(1001)]
    stalled = [t for t in even if not 400 * MS < t < 700 * MS]  # 300 ms without a step
    lost = gcra_allowed(even, 100, 100 * MS, 1) - gcra_allowed(stalled, 100, 100 * MS, 1)
    assert lost == 30 - 11  # 300 ms of 100 tok/s, less the burst (11) it refilled


def test_a_token_a_stream_a_step() -> None:
    times = [i * 10 * MS for i in range(101)]  # 100 steps/s for 1 s
    assert gcra_allowed(times, 1000, 100 * MS, 1) == 101  # the steps bound it, not the limit
    assert gcra_allowed(times, 1000, 100 * MS, 4) == 404
    assert gcra_allowed([], 100, 100 * MS, 1) == 0


def test_the_allowed_rate_is_the_steps_between_the_users_first_and_last() -> None:
    # The engine stepped 50 times a second for 2 s; the user got a token in
    # every other step (25 tok/s) from 0.5 s to 1.5 s.
    lines = [{"t": i * 20 * MS, "step": i} for i in range(101)]
    steps = [(t, 1) for t in range(500 * MS, 1500 * MS + 1, 40 * MS)]
    rate = steps_allowed_rate(lines, steps, 100, 100 * MS, 1)
    assert rate == 50  # 51 steps in 1 s, a token each: the steps bound a 100 tok/s limit
    assert steps_allowed_rate(lines, steps, 10, 100 * MS, 1) == 10 + 1  # the limit and its burst
    assert steps_allowed_rate(lines, steps[:1], 100, 100 * MS, 1) == 100  # no span: the limit


def test_a_drained_bucket_grants_the_limit_and_no_burst() -> None:
    times = [i * MS for i in range(1001)]  # 1 s of 1 ms steps, in the middle of a run
    assert gcra_allowed(times, 100, 100 * MS, 1, drained=True) == 100
    stalled = [t for t in times if not 400 * MS < t < 700 * MS]  # 300 ms without a step
    assert gcra_allowed(stalled, 100, 100 * MS, 1, drained=True) == 100 - 30 + 11
