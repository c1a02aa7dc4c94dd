"""Parking (vllm_integration/step/parking.py) on the real vLLM Scheduler and
AsyncScheduler: for the length of a step, the waiting requests admission
would only defer again are out of the queue stock walks, and everything
else is as without it: what is admitted when, the deferral counts, the
queue's order."""

from __future__ import annotations

from itertools import pairwise

import pytest

pytest.importorskip("vllm")

from test_scheduler_slots import KINDS, check_invariants, policy  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import MS, Driver, FakeClock, make_request, make_scheduler  # noqa: E402

from vllm_integration.step.parking import Parking  # noqa: E402

pytestmark = pytest.mark.vllm

THROTTLED = "version: 1\ndefault: unlimited\nusers:\n  a: {rate: 20, burst: 200ms}\n"


def backlog(kind: str, n: int = 64, **config):
    """`a` with `n` requests on 8 slots (6 active), 12 steps in: 7 of them
    resident, held by its 20 tok/s, and one slot free, kept for users with
    budget: the case where stock's waiting loop runs every step and
    admission defers each of a's waiting requests again."""
    clock = FakeClock()
    s = make_scheduler(
        kind, policy(THROTTLED), clock, max_num_seqs=8, max_num_active_seqs=6, **config
    )
    d = Driver(s, clock, step_ns=10 * MS)
    reqs = [d.add(make_request("a", max_tokens=200)) for _ in range(n)]
    d.run(12)
    check_invariants(s)
    assert len(s.running) + s.n_held == 7
    return s, d, reqs


def count_visits(s) -> list:
    """Every request stock's waiting loop hands to admission from now on."""
    visits: list = []
    admit = s.admission.admit
    s.admission.admit = lambda request, *a: visits.append(request) or admit(request, *a)
    return visits


@pytest.mark.parametrize("kind", KINDS)
def test_a_throttled_users_backlog_is_not_visited_by_a_step(kind):
    """Without parking, stock's waiting loop handed each of a's 57 deferred
    requests to admission every step (~2 us each here)."""
    s, d, _ = backlog(kind)
    assert len(s.waiting) == 57 and s.get_request_counts()[1] == 57
    parked = []
    park = s.parking.park
    s.parking.park = lambda *a: parked.append(park(*a)) or parked[-1]
    visits = count_visits(s)
    before = d.tokens_of("a")
    for _ in range(50):  # 0.5 s
        d.step()
        check_invariants(s)
        assert len(s.waiting) == 57 and len(s.parking) == 0  # back after each step
    assert not visits
    assert parked == [57] * 50
    assert d.tokens_of("a") - before >= 8  # its resident streams go on at its 20 tok/s


@pytest.mark.parametrize("kind", KINDS)
def test_a_user_with_budget_behind_the_backlog_is_admitted_at_once(kind):
    """b arrives behind a's 57 deferred requests: stock's loop reaches it
    at once (to the slot kept for users with budget), a's not at all."""
    s, d, _ = backlog(kind)
    visits = count_visits(s)
    b = d.add(make_request("b", max_tokens=5))
    d.step()
    check_invariants(s)
    assert visits == [b] and b.status == RequestStatus.RUNNING
    d.run(3)
    assert d.emitted.get(b.request_id, 0) >= 1


def ask(user: str, name: str, tokens: int, priority: int = 0, prompt_len: int = 8):
    """A request named `name`: two plays compare by name."""
    return make_request(
        user, prompt_len=prompt_len, max_tokens=tokens, priority=priority, req_id=name
    )


def play(kind: str, parking: bool, priority: bool = False) -> tuple:
    """A throttled user's backlog (a), a throttled user capped at
    `max_streams` (m), a user whose long prompts wait for prompt budget
    (p), an unlimited user arriving in bursts (u), an abort and a reload
    that lifts every limit, on 8 slots (6 active): each step's scheduled
    tokens, the queue's order and the deferral counts after it, with parking
    or with it switched off; and how many request-steps were parked."""
    text = (
        "version: 1\ndefault: unlimited\nusers:\n  a: {rate: 20, burst: 200ms}\n"
        "  m: {rate: 30, max_streams: 2}\n  p: {rate: 50, prompt: 400}\n"
    )
    clock = FakeClock()
    s = make_scheduler(
        kind, policy(text), clock, max_num_seqs=8, max_num_active_seqs=6, priority=priority
    )
    parked = [0]
    park = s.parking.park

    def counted(*args) -> int:
        n = park(*args)
        parked[0] += n
        return n

    s.parking.park = counted if parking else (lambda *args: 0)
    d = Driver(s, clock, step_ns=10 * MS)
    reqs = [d.add(ask("a", f"a{i}", 30, i % 3)) for i in range(24)]
    reqs += [d.add(ask("m", f"m{i}", 20, i % 2)) for i in range(6)]
    reqs += [d.add(ask("p", f"p{i}", 10, prompt_len=120)) for i in range(4)]
    trail = []
    for step in range(900):
        if step % 40 == 0 and step < 400:
            reqs += [d.add(ask("u", f"u{step}.{i}", 8)) for i in range(3)]
        if step == 150:
            s.finish_requests([reqs[20].request_id], RequestStatus.FINISHED_ABORTED)
        if step == 500:
            s.policy_box.current = policy("version: 1\ndefault: unlimited\n")
        out = d.step()
        check_invariants(s)
        why = {r.request_id: r.__dict__["_outrate"].deferred for r in s.waiting}
        trail.append((dict(out.num_scheduled_tokens), list(why), why, dict(s.metrics.deferred)))
    d.drain()
    return (trail, dict(d.emitted), d.finished), parked[0]


@pytest.mark.parametrize("priority", [False, True], ids=["fcfs", "priority"])
@pytest.mark.parametrize("kind", KINDS)
def test_parking_changes_nothing_but_the_visits(kind, priority):
    with_parking, parked = play(kind, True, priority)
    without, none = play(kind, False, priority)
    assert with_parking == without and none == 0
    trail, _, finished = with_parking
    changed = {(a.get(r), b[r]) for (*_, a, _), (*_, b, _) in pairwise(trail) for r in b}
    assert ("max_streams", "budget") in changed  # a reason changes: admission sees it
    assert parked > 2000  # request-steps out of stock's loop
    assert len(finished) == 24 + 6 + 4 + 30 - 1  # all done but the one aborted


def test_parking_puts_stocks_front_first_then_the_queue_in_its_order():
    """On vLLM's FCFS queue: what stock put at the front during the step (a
    preempted request) stays first; the parked go back between the others
    where they were, what was admitted is gone."""
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    rs = [make_request("a") for _ in range(6)]
    q = FCFSRequestQueue()
    for r in rs:
        q.add_request(r)
    p = Parking(admission=None, st=None)  # type: ignore[arg-type]
    p._before = list(q)
    p.parked = {rs[1], rs[3], rs[4]}
    q.remove_requests(p.parked)
    q.remove_request(rs[2])  # admitted during the step
    x = make_request("b")
    q.prepend_request(x)  # preempted during the step
    p.unpark(q, fcfs=True)
    assert list(q) == [x, rs[0], rs[1], rs[3], rs[4], rs[5]]
    assert not p.parked and len(p) == 0
