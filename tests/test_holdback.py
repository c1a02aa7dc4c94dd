"""Holdback without vLLM: holding, waking, rotation and victims over the
scheduler's plain records, with a real Limiter and a fake clock."""

from __future__ import annotations

from outrate.budget.limiter import Limiter
from outrate.observe.metrics import Metrics
from outrate.policy.pipeline import policy_from_flags
from vllm_integration.step.holdback import Holdback
from vllm_integration.step.state import ATTR, RequestState, UserState

S = 1_000_000_000


class Req:
    """What Holdback reads of a vLLM Request: a __dict__, priority, arrival."""

    def __init__(self, user: UserState, priority: int = 0, arrival: float = 0.0) -> None:
        self.priority = priority
        self.arrival_time = arrival
        self.__dict__[ATTR] = RequestState(user)


def setup(rate: float = 10, priority: bool = False):
    limiter = Limiter(policy_from_flags(rate, None), clock=lambda: 0)
    metrics = Metrics()
    hb = Holdback(limiter, priority, metrics)

    def user(key: str) -> UserState:
        return UserState(key, limiter.pin(key), metrics.record(key))

    return hb, limiter, user, metrics


def spend(limiter: Limiter, u: UserState, now: int) -> None:
    while limiter.take(u.bucket, now):
        pass


def test_held_requests_come_back_oldest_first_when_budget_returns():
    hb, limiter, user, metrics = setup(rate=10)
    alice = user("alice")
    spend(limiter, alice, 0)
    reqs = [Req(alice) for _ in range(3)]
    for i, r in enumerate(reqs):
        hb.hold(r, now=i)
    hb.arm(alice, 0)
    assert len(hb) == 3 and alice.n_held == 3 and alice.m.held == 3
    assert hb.earliest_ready() == alice.ready_at > 0
    running: list = []
    assert hb.release_ready(alice.ready_at - 1, room=8, running=running) == []
    assert running == []
    rearm = hb.release_ready(alice.ready_at, room=8, running=running)
    assert running == [reqs[0]]  # one token of budget: one stream, the oldest
    assert rearm == [alice] and alice.n_held == 2
    assert (metrics.holds, metrics.releases) == (3, 1)
    assert alice.m.wait.sum_ns == alice.ready_at - 0


def test_room_caps_releases_and_release_all_empties_everything():
    hb, limiter, user, _ = setup(rate=1000)
    bob = user("bob")
    reqs = [Req(bob) for _ in range(5)]
    for r in reqs:
        hb.hold(r, 0)
    hb.arm(bob, 0)
    running: list = []
    hb.release_ready(S, room=2, running=running)
    assert running == reqs[:2]
    hb.release_all([bob], S, running)
    assert running == reqs and not hb and bob.n_held == 0 and not hb.wake
    assert bob.m.held == 0 and bob.m.held_since_sum == 0


def test_stale_entries_are_skipped():
    hb, limiter, user, _ = setup(rate=10)
    carol = user("carol")
    a, b = Req(carol), Req(carol)
    hb.hold(a, 0)
    hb.hold(b, 0)
    hb.leave(a.__dict__[ATTR], a, 5)  # finished while held
    hb.arm(carol, 0)
    running: list = []
    hb.release_ready(10 * S, room=8, running=running)
    assert running == [b]
    carol.armed = False  # its wake entry is stale now
    hb.arm(carol, 0)
    carol.ready_at += 1
    assert hb.earliest_ready() == 0  # the only entry is stale and dropped


def test_kv_victim_fcfs_is_the_most_recently_held():
    hb, _, user, _ = setup()
    u = user("u")
    first, last = Req(u), Req(u)
    hb.hold(first, 0)
    hb.hold(last, 1)
    assert hb.kv_victim(running=[]) is last


def test_kv_victim_priority_respects_visible_lower_priority_requests():
    hb, _, user, _ = setup(priority=True)
    u = user("u")
    urgent, lax = Req(u, priority=0, arrival=1.0), Req(u, priority=5, arrival=0.5)
    hb.hold(urgent, 0)
    hb.hold(lax, 0)
    assert hb.kv_victim(running=[]) is lax
    visible = Req(u, priority=9)
    assert hb.kv_victim(running=[visible]) is None  # stock preempts the visible one first


def test_displacement_takes_from_the_user_with_the_most_slots_only_if_unfair():
    hb, _, user, _ = setup()
    hog, newcomer = user("hog"), user("newcomer")
    reqs = [Req(hog) for _ in range(3)]
    for r in reqs:
        hb.hold(r, 0)
    hog.resident, newcomer.resident = 3, 1
    assert hb.displacement_victim(newcomer, [hog, newcomer]) is reqs[-1]  # youngest held
    hog.resident = 2
    assert hb.displacement_victim(newcomer, [hog, newcomer]) is None  # 2 vs 1: fair enough


def test_hold_refused_holds_only_running_requests_stock_did_not_schedule():
    hb, _, user, metrics = setup()
    alice = user("alice")
    reqs = [Req(alice) for _ in range(4)]
    for i, r in enumerate(reqs):
        r.request_id = f"r{i}"
        r.status = "RUNNING" if i != 3 else "WAITING"
    refused = [reqs[0], reqs[1], reqs[3]]
    # r0 was scheduled after all (a later token of the step), r3 is not running.
    held = hb.hold_refused(refused, {"r0": 1}, now=5, running_status="RUNNING")
    assert list(held) == [reqs[1]] == list(hb.held) and refused == [] and metrics.holds == 1
    refused = [reqs[2], reqs[0], reqs[2]]  # refused twice in a step: held once
    held = hb.hold_refused(refused, {}, now=6, running_status="RUNNING")
    assert list(held) == [reqs[2], reqs[0]]  # in the order they were refused
    assert len(hb) == 3 and alice.n_held == 3 and metrics.holds == 3


def test_earliest_ready_is_the_earlier_of_the_wake_heap_and_a_blocked_admission():
    hb, limiter, user, _ = setup(rate=10)
    alice = user("alice")
    assert hb.earliest_ready() == 0 and hb.earliest_ready(7) == 7
    spend(limiter, alice, 0)
    hb.hold(Req(alice), now=0)
    hb.arm(alice, 0)
    ready = alice.ready_at
    assert hb.earliest_ready() == ready
    assert hb.earliest_ready(ready - 1) == ready - 1
    assert hb.earliest_ready(ready + 1) == ready
    alice.armed = False  # its entry goes stale: only the blocked time is left
    assert hb.earliest_ready(ready + 1) == ready + 1
