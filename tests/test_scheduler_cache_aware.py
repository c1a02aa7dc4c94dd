"""vLLM 0.34's cache-aware admission (`--cache-aware-admission-window N`)
under outrate: stock reorders the head of `waiting` by cached prefix at the
start of the waiting phase; outrate's deferral (a throttled or
`max_streams`-capped user's request is skipped, not blocking), `max_streams`
and the GCRA bound must hold whatever the order. Supported, so tested here on
the real 0.34 scheduler (skipped on releases without the option)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from vllm.config import SchedulerConfig  # noqa: E402
from vllm_harness import MS, Driver, FakeClock, make_request, make_scheduler  # noqa: E402

from outrate.observe.trace import max_window_excess  # noqa: E402
from outrate.policy.compiler import compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402

pytestmark = pytest.mark.skipif(
    "cache_aware_admission_window" not in {f.name for f in dataclasses.fields(SchedulerConfig)},
    reason="this vLLM has no cache-aware admission (0.34 and later)",
)

POLICY = "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  a: {rate: 50, max_streams: 2}\n"
PREFIX = [(i * 7) % 400 + 5 for i in range(64)]


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("window", [0, 8])
def test_deferral_max_streams_and_the_bound_hold_with_cache_aware_admission(kind, window):
    clock = FakeClock()
    pol = compile_policy(parse_policy(POLICY, "p.yaml"), "p.yaml")
    s = make_scheduler(
        kind,
        pol,
        clock,
        max_num_seqs=8,
        max_num_active_seqs=6,
        scheduler={
            "cache_aware_admission_window": window,
            "cache_aware_admission_threshold": 0.0,
        },
    )
    d = Driver(s, clock, step_ns=10 * MS)
    # a: six prompts sharing a 64-token prefix (cache hits after the first);
    # b: cold prompts arriving between them.
    for i in range(6):
        d.add(make_request("a", prompt=PREFIX + [300 + i], max_tokens=20))
        d.add(make_request("b", prompt_len=40, max_tokens=20))
    worst_resident = 0
    for _ in range(3000):
        if not s.has_requests():
            break
        d.step()
        u = s.roster.users.get("a")
        if u is not None:
            worst_resident = max(worst_resident, u.resident)
    d.drain()
    assert not s.has_requests()
    assert d.tokens_of("a") == 120 and d.tokens_of("b") == 120
    assert worst_resident <= 2  # max_streams held through the reordering
    steps: dict[int, int] = {}
    for t, user in d.timeline:
        if user == "a":
            steps[t] = steps.get(t, 0) + 1
    excess = max_window_excess(sorted(steps.items()), 50, 100 * MS)
    assert excess <= 1e-6  # delivered one step after dispatch: the same spacing
    b_done = max(t for t, user in d.timeline if user == "b")
    a_done = max(t for t, user in d.timeline if user == "a")
    assert b_done < a_done  # b was never held behind a's deferred requests
