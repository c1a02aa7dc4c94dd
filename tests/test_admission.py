"""Admission and the roster without vLLM: deferral by stream cap and budget,
prefill-ahead rules, fair displacement, and the user table's pin lifecycle,
over the scheduler's plain records with a real Limiter."""

from __future__ import annotations

from outrate.budget.limiter import Limiter
from outrate.observe.metrics import Metrics
from outrate.policy.compiler import compile_policy
from outrate.policy.loader import parse_policy
from vllm_integration.step.admission import Admission
from vllm_integration.step.holdback import Holdback
from vllm_integration.step.roster import Roster
from vllm_integration.step.state import ATTR, StepScratch

POLICY = """\
version: 1
default: 10
users:
  capped: {rate: 1000, max_streams: 1}
  shadowed: {rate: 1, shadow: true}
"""


class Req:
    """What Admission reads of a vLLM Request."""

    def __init__(self, num_tokens: int = 8, computed: int = 0, priority: int = 0) -> None:
        self.num_tokens = num_tokens
        self.num_computed_tokens = computed
        self.priority = priority
        self.arrival_time = 0.0


def setup(chunked: bool = True, caching: bool = False):
    policy = compile_policy(parse_policy(POLICY, "p.yaml"), "p.yaml")
    limiter = Limiter(policy, clock=lambda: 0)
    metrics = Metrics()
    holdback = Holdback(limiter, False, metrics)
    roster = Roster(limiter, metrics)
    adm = Admission(
        limiter, metrics, holdback, StepScratch(), chunked=chunked, caching=caching, block_size=4
    )

    def request(user: str, running: bool = False, **kw: int) -> Req:
        r = Req(**kw)
        roster.register(r, user, policy, running)  # type: ignore[arg-type]
        return r

    return adm, roster, limiter, request, metrics


def admit(adm: Admission, r: Req, st: StepScratch, running: int = 0, cap: int = 8) -> bool:
    assert st is adm.st  # the scheduler's scratch, handed to Admission when built
    return adm.admit(r, step=1, now=0, running=running, max_active=cap)  # type: ignore[arg-type]


def test_a_user_with_budget_is_admitted_and_counted_resident_at_once():
    adm, _, _, request, _ = setup()
    st = adm.st
    r = request("alice")
    assert admit(adm, r, st)
    rs = r.__dict__[ATTR]
    assert rs.resident and rs.user.resident == 1 and st.admits == [r]


def test_max_streams_defers_and_counts_once_per_deferral():
    adm, _, _, request, metrics = setup()
    st = adm.st
    assert admit(adm, request("capped"), st)
    second = request("capped")
    assert not admit(adm, second, st)
    assert not admit(adm, second, st)  # still waiting: not counted again
    assert metrics.deferred["max_streams"] == 1
    assert second.__dict__[ATTR].deferred == "max_streams"


def test_out_of_budget_prefills_ahead_only_with_chunking_and_a_free_seat():
    adm, _, limiter, request, metrics = setup(chunked=True)
    st = adm.st
    r = request("bob")
    u = r.__dict__[ATTR].user
    while limiter.take(u.bucket, 0):
        pass
    assert admit(adm, r, st, running=0, cap=8)  # prefill without sampling
    late = request("bob")
    assert not admit(adm, late, st, running=7, cap=8)  # the last seat is kept
    assert metrics.deferred["budget"] == 1
    assert st.blocked_ready == limiter.ready_at(u.bucket, 0) > 0
    adm.chunked = False
    assert not admit(adm, request("bob"), st)


def test_prefill_ahead_needs_a_positive_cap_whatever_the_cache_hit():
    adm, *_ = setup(chunked=True, caching=True)
    assert adm.can_prefill_ahead(Req(num_tokens=6))  # (6 - 1) % 4 != 0
    assert not adm.can_prefill_ahead(Req(num_tokens=5))  # a full-block hit leaves nothing
    assert not adm.can_prefill_ahead(Req(num_tokens=1))
    assert not adm.can_prefill_ahead(Req(num_tokens=6, computed=2))  # preempted: resumes


def test_shadow_limits_never_defer():
    adm, _, limiter, request, _ = setup()
    st = adm.st
    r = request("shadowed")
    while limiter.take(r.__dict__[ATTR].user.bucket, 0):
        pass
    assert admit(adm, r, st, running=7, cap=8)


def test_displacement_takes_from_the_user_holding_most_slots_for_one_with_budget():
    adm, roster, limiter, request, _ = setup()
    hogs = [request("hog", running=True) for _ in range(3)]
    hog = hogs[0].__dict__[ATTR].user
    while limiter.take(hog.bucket, 0):
        pass
    for i, r in enumerate(hogs):
        adm.holdback.hold(r, now=i)  # type: ignore[arg-type]
    assert adm.displacement(roster.users.values(), step=1, now=0) is None  # nobody waits
    request("newcomer")
    victim = adm.displacement(roster.users.values(), step=1, now=0)
    assert victim is hogs[-1]  # the youngest held


def test_displacement_finds_a_waiting_user_wherever_its_requests_stand():
    """Users, not queue positions: a newcomer behind any number of waiting
    requests of users without budget is seen, and among candidates the one
    holding the fewest slots goes first."""
    adm, roster, limiter, request, _ = setup()
    hogs = [request("hog", running=True) for _ in range(4)]
    hog = hogs[0].__dict__[ATTR].user
    while limiter.take(hog.bucket, 0):
        pass
    for i, r in enumerate(hogs):
        adm.holdback.hold(r, now=i)  # type: ignore[arg-type]
    for _ in range(200):
        request("hog")  # its own backlog: no budget, held requests
    request("carol", running=True)
    request("carol")
    request("dave")
    victim = adm.displacement(roster.users.values(), step=1, now=0)
    assert victim is hogs[-1]
    assert adm.displacement([roster.users["carol"], hog], step=1, now=0) is hogs[-1]
    assert adm.displacement([hog], step=1, now=0) is None  # only the hog waits


def test_the_roster_pins_a_user_while_it_has_live_requests():
    _, roster, limiter, request, metrics = setup()
    a, b = request("carol"), request("carol", running=True)
    u = a.__dict__[ATTR].user
    assert roster.users == {"carol": u} and u.live == 2 and u.resident == 1
    assert u.bucket.pins == 1 and metrics.record("default").live == 2
    roster.finish(a.__dict__[ATTR])
    assert "carol" in roster.users and u.bucket.pins == 1
    roster.finish(b.__dict__[ATTR])
    assert roster.users == {} and u.bucket.pins == 0 and metrics.record("default").live == 0
    assert limiter.cleanup(10**12, 8) == 1  # unpinned and idle: the store may forget it
