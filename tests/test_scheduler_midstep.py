"""Adds and aborts between `schedule()` and `update_from_output()`.

vLLM 0.34's multiprocess engine core handles its input queue while a step
runs (`EngineCoreProc._wait_for_output`), so outrate's `add_request` and
`_free_request` can run in the middle of a step, an abort of a request charged
in that very step included. Earlier versions never do it in the sync engine,
but the scheduler must hold its books either way: nothing charged twice,
nothing left resident or held, each user's counts right. Driven on the real
Scheduler / AsyncScheduler of whichever vLLM is installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import MS, TOKEN, FakeClock, make_request, make_scheduler  # noqa: E402

from outrate.policy.pipeline import policy_from_flags  # noqa: E402
from vllm_integration.offline.outputs import model_runner_output  # noqa: E402

ABORTED = RequestStatus.FINISHED_ABORTED


def _outputs(sched, out):
    ids = list(out.num_scheduled_tokens)
    reqs = sched.requests
    sampled = [[] if r in reqs and reqs[r].is_prefill_chunk else [TOKEN] for r in ids]
    return model_runner_output(ids, sampled)


def _tokens(sched, label: str) -> int:
    m = sched.metrics.labels.get(label)
    return 0 if m is None else m.tokens


def _user(sched, key: str):
    return sched.roster.users.get(key)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_request_charged_in_a_step_and_aborted_before_its_output(kind):
    clock = FakeClock()
    sched = make_scheduler(kind, policy_from_flags(None, {"a": 1000}), clock)
    a1, a2 = make_request("a", max_tokens=50), make_request("a", max_tokens=50)
    sched.add_request(a1)
    sched.add_request(a2)
    pending = []
    for _ in range(3):  # prefill, then decodes: both charged in each step
        out = sched.schedule()
        pending.append(out)
        if kind == "sync" or len(pending) == 2:
            done = pending.pop(0)
            sched.update_from_output(done, _outputs(sched, done))
        clock.advance(10 * MS)
    before = _tokens(sched, "a")
    out = sched.schedule()  # step N: both charged
    assert _tokens(sched, "a") == before + 2
    sched.finish_requests([a1.request_id], ABORTED)  # the abort, mid-step
    pending.append(out)
    while pending:
        done = pending.pop(0)
        sched.update_from_output(done, _outputs(sched, done))
    assert _tokens(sched, "a") == before + 2  # charged once, not refunded, not again
    u = _user(sched, "a")
    assert (u.live, u.resident, u.n_held) == (1, 1, 0)
    clock.advance(10 * MS)
    out = sched.schedule()  # step N+1: only the survivor
    assert list(out.num_scheduled_tokens) == [a2.request_id]
    assert _tokens(sched, "a") == before + 3
    sched.update_from_output(out, _outputs(sched, out))
    sched.finish_requests([a2.request_id], ABORTED)
    assert _user(sched, "a") is None  # the user goes with its last request
    assert sched.n_held == 0 and not sched.running


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_held_request_aborted_mid_step_leaves_nothing_held(kind):
    clock = FakeClock()
    sched = make_scheduler(kind, policy_from_flags(None, {"slow": 1}), clock, max_num_seqs=8)
    reqs = [make_request("slow", max_tokens=20) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    held_seen = False
    for _ in range(6):
        out = sched.schedule()
        if sched.n_held:
            held_seen = True
            victim = next(r for r in reqs if r in sched.holdback.held)
            sched.finish_requests([victim.request_id], ABORTED)  # mid-step, while held
            sched.update_from_output(out, _outputs(sched, out))
            break
        sched.update_from_output(out, _outputs(sched, out))
        clock.advance(10 * MS)
    assert held_seen
    u = _user(sched, "slow")
    assert u.live == 2 and u.n_held == len(sched.holdback) and u.resident == 2
    charged = _tokens(sched, "slow")
    for r in reqs:
        if r.request_id in sched.requests:
            sched.finish_requests([r.request_id], ABORTED)
    assert _user(sched, "slow") is None and sched.n_held == 0
    assert _tokens(sched, "slow") == charged


def test_a_request_added_mid_step_joins_the_next_step_once():
    clock = FakeClock()
    sched = make_scheduler("sync", policy_from_flags(None, {"b": 1000}), clock)
    first = make_request("b", max_tokens=20)
    sched.add_request(first)
    out = sched.schedule()
    late = make_request("b", max_tokens=20)
    sched.add_request(late)  # arrives while the step runs
    sched.update_from_output(out, _outputs(sched, out))
    assert _user(sched, "b").live == 2 and _user(sched, "b").resident == 1
    clock.advance(10 * MS)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {first.request_id, late.request_id}
    assert _user(sched, "b").resident == 2
    assert _tokens(sched, "b") == 3  # first: 2 steps; late: its first token
