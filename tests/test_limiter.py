"""Limiter: the GCRA decision, its bounds, refunds, cleanup, policy swaps, stats.

The property tests marked `@every_store` (agreement with GCRA, the window
bound, the greedy rate, refunds, policy swaps, available/ready_at) talk only
to the `BudgetStore` protocol and run against every store in `STORES`: the
in-memory `Limiter`, and the `Limiter` lent by a `SharedBudget`, both leased
and in its fallback. The rest test the in-memory `Limiter`'s own API (keyed verbs,
stats, cleanup, export).

No test sleeps: every call passes `now` (ns) explicitly or reads a fake clock.
Bounds are checked in exact arithmetic (Fractions over the rate as written),
independently of the limiter's scaled units.
"""

from __future__ import annotations

import bisect
import importlib.util
import math
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outrate.budget.limiter import NS_PER_S, Account, Bucket, Limit, Limiter, gcra
from outrate.budget.shared.credit import Mode, SharedBudget
from outrate.budget.store import BudgetStore
from outrate.identity.core import ANONYMOUS
from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.loader import parse_policy
from outrate.policy.pipeline import policy_from_flags

SETTINGS = settings(max_examples=200, deadline=None)

BENCH = Path(__file__).parent.parent / "benchmarks" / "bench_limiter.py"

RATES = [
    Fraction(1, 3),
    "1/3",
    Fraction(1, 2),
    "0.5",
    "0.1",
    1,
    Fraction(5, 2),
    "7",
    10,
    Fraction(1000, 7),
    100,
    1000,
]
"""Rates as a policy writes them, fractions included, from 1 per 10 s to 1000/s."""

rates = st.sampled_from(RATES)
bursts = st.integers(1_000_000, 2 * NS_PER_S)  # 1ms .. 2s
# Gaps between requests: many at the same instant, some tiny, some long.
gaps = st.one_of(
    st.just(0),
    st.integers(0, 1_000),
    st.integers(0, 20_000_000),
    st.integers(0, 3 * NS_PER_S),
)
# A step is a gap, or a visit exactly when the next token is due ("ready", the
# greediest client there is) or one ns before ("early"): off-by-ones show there.
steps = st.one_of(gaps, st.sampled_from(["ready", "early"]))


def next_time(now: int, step: int | str, ready: int) -> int:
    if step == "ready":
        return max(now, ready)
    if step == "early":
        return max(now, ready - 1)
    return now + int(step)


def times_from(start: int, deltas: list[int]) -> list[int]:
    out, now = [], start
    for d in deltas:
        now += d
        out.append(now)
    return out


def policy_of(default: Limit, **users: Limit) -> CompiledPolicy:
    return CompiledPolicy(
        source="test", default=default, anonymous=default, burst_ns=default.burst_ns, users=users
    )


def limiter_for(limit: Limit) -> Limiter:
    return Limiter(policy_of(limit), clock=_no_clock)


def _no_clock() -> int:
    raise AssertionError("the test passes `now` explicitly; the clock must not be read")


def memory_store(policy: CompiledPolicy) -> BudgetStore:
    return Limiter(policy, clock=_no_clock)


class _Ample(SharedBudget):
    """A shared budget whose lease thread has always answered with ample
    credit: credit never binds, so the local GCRA alone decides (Redis's
    side, the credit, is tested against a real server in test_shared.py)."""

    def open(self, b: Bucket) -> Account:
        credit = super().open(b)
        credit.granted = 1 << 40
        return credit


def shared_store(policy: CompiledPolicy) -> BudgetStore:
    budget = _Ample()
    budget.mode = Mode(shared=True)  # as the lease thread publishes after its first round
    return Limiter(policy, clock=_no_clock, lender=budget)


def shared_store_down(policy: CompiledPolicy) -> BudgetStore:
    """A shared store that never reached Redis, alone (N = 1): its fallback."""
    return Limiter(policy, clock=_no_clock, lender=SharedBudget(engines_hint=1))


STORES: dict[str, Callable[[CompiledPolicy], BudgetStore]] = {
    "memory": memory_store,
    "shared": shared_store,
    "shared-down": shared_store_down,
}
"""Every BudgetStore the scheduler can run on, by name."""

every_store = pytest.mark.parametrize("make_store", list(STORES.values()), ids=list(STORES))


def store_for(make_store: Callable[[CompiledPolicy], BudgetStore], limit: Limit) -> BudgetStore:
    return make_store(policy_of(limit))


class RefGCRA:
    """GCRA written the textbook way, in Fraction nanoseconds: the oracle the
    limiter's scaled integers must agree with."""

    def __init__(self, limit: Limit) -> None:
        assert limit.rate is not None
        self.emission = NS_PER_S / limit.rate
        self.burst = limit.burst_ns
        self.tat = Fraction(0)

    def take(self, now: int) -> bool:
        tat = max(self.tat, Fraction(now))
        if tat - now > self.burst:
            return False
        self.tat = tat + self.emission
        return True

    def ready(self) -> int:
        """The first whole ns at which a take conforms."""
        return math.ceil(self.tat - self.burst)


# -- 1. gcra() and agreement with it ----------------------------------------


def test_gcra_fresh_and_idle_users_conform() -> None:
    assert gcra(0, 0, 10, 5) == (1, 10)
    assert gcra(3, 100, 10, 0) == (1, 110)  # a TAT in the past counts as now


def test_gcra_tolerance_boundary_is_inclusive() -> None:
    assert gcra(105, 100, 10, 5) == (1, 115)
    assert gcra(106, 100, 10, 5) == (0, 106)
    assert gcra(100, 100, 10, 0) == (1, 110)  # zero tolerance: exactly on time conforms
    assert gcra(101, 100, 10, 0) == (0, 101)


def test_gcra_burst_then_pacing() -> None:
    """interval 10, tolerance 25: 3 at once, then one per 10, each exactly
    when the TAT is no more than the tolerance ahead."""
    tat, grants = 0, []
    for now in [0, 0, 0, 0, 4, 5, 14, 15, 15, 25]:
        k, tat = gcra(tat, now, 10, 25)
        grants.append(k == 1)
    assert grants == [True, True, True, False, False, True, False, True, False, True]


def test_gcra_answers_how_many_of_n_conform() -> None:
    """interval 10, tolerance 25, fresh: 3 conform at once, whatever is asked
    beyond; at 5 a fourth; none asked, none taken."""
    assert gcra(0, 0, 10, 25, 2) == (2, 20)
    assert gcra(0, 0, 10, 25, 100) == (3, 30)
    assert gcra(30, 5, 10, 25, 100) == (1, 40)
    assert gcra(30, 5, 10, 25, 0) == (0, 30)


@SETTINGS
@given(
    tat=st.integers(0, 10**6),
    now=st.integers(0, 10**6),
    interval=st.integers(1, 10**4),
    tolerance=st.integers(0, 10**5),
    n=st.integers(0, 200),
)
def test_gcra_of_n_is_n_single_decisions(
    tat: int, now: int, interval: int, tolerance: int, n: int
) -> None:
    """Asking for n at once takes what n single asks at `now` take, and
    leaves the same TAT."""
    one_tat, took = tat, 0
    for _ in range(n):
        k, one_tat = gcra(one_tat, now, interval, tolerance)
        took += k
    k, bulk_tat = gcra(tat, now, interval, tolerance, n)
    assert k == took
    assert max(bulk_tat, now) == max(one_tat, now)


def test_limit_rates_are_exact() -> None:
    assert Limit("1/3", 10**8).rate == Fraction(1, 3)
    assert Limit(" 2/6 ", 10**8).rate == Fraction(1, 3)
    assert Limit("0.1", 10**8).rate == Fraction(1, 10)
    assert Limit(0.1, 10**8).rate == Fraction(1, 10)
    lim = Limit(Fraction(1000, 7), 10**8)
    assert (lim.scale, lim.interval, lim.tolerance) == (1000, 7 * NS_PER_S, 10**11)


@pytest.mark.parametrize("bad", ["abc", "1/0", "-1", "0", "nan", "inf"])
def test_limit_rejects_bad_rate_strings_with_value_error(bad: str) -> None:
    with pytest.raises(ValueError):
        Limit(bad, 10**8)


@every_store
@SETTINGS
@given(
    limits=st.lists(st.tuples(rates, bursts), min_size=1, max_size=3),
    ops=st.lists(st.tuples(st.integers(0, 2), steps), max_size=150),
)
def test_take_agrees_with_gcra_and_the_textbook(
    make_store: Callable[[CompiledPolicy], BudgetStore],
    limits: list[tuple[str | int | Fraction, int]],
    ops: list[tuple[int, int | str]],
) -> None:
    """Each user has its own limit; the store, `gcra()` over the limit's
    integers and a Fraction-ns textbook GCRA decide the same, every time."""
    lims = [Limit(r, b) for r, b in limits]
    users = {f"u{i}": lim for i, lim in enumerate(lims)}
    store = make_store(policy_of(lims[0], **users))
    buckets = {u: store.pin(u) for u in users}
    tats = dict.fromkeys(users, 0)
    refs = {u: RefGCRA(lim) for u, lim in users.items()}
    now = 0
    for i, step in ops:
        user, lim = f"u{i % len(lims)}", lims[i % len(lims)]
        now = next_time(now, step, refs[user].ready())
        k, tats[user] = gcra(tats[user], now * lim.scale, lim.interval, lim.tolerance)
        assert store.take(buckets[user], now) == (k == 1) == refs[user].take(now)


@SETTINGS
@given(ops=st.lists(st.tuples(steps, st.booleans()), max_size=100))
def test_the_keyed_api_makes_the_bucket_apis_decision(ops: list[tuple[int | str, bool]]) -> None:
    lim = Limit(Fraction(5, 2), 300_000_000)
    keyed, direct = limiter_for(lim), limiter_for(lim)
    b = direct.bucket("u")
    now = 0
    for step, _ in ops:
        now = next_time(now, step, direct.ready_at(b, now))
        assert keyed.try_take("u", now) == direct.take(b, now)


# -- 2. the bound over any window -------------------------------------------


@every_store
@SETTINGS
@given(
    rate=rates,
    burst=bursts,
    plan=st.lists(steps, max_size=200),
    window=st.integers(0, 10 * NS_PER_S),
)
def test_no_window_grants_more_than_rate_times_window_plus_burst_plus_one(
    make_store: Callable[[CompiledPolicy], BudgetStore],
    rate: str | int | Fraction,
    burst: int,
    plan: list[int | str],
    window: int,
) -> None:
    lim = Limit(rate, burst)
    r = lim.rate
    assert r is not None
    limiter = store_for(make_store, lim)
    b = limiter.pin("u")
    granted, now = [], 10**12
    for step in plan:
        now = next_time(now, step, limiter.ready_at(b, now))
        if limiter.take(b, now):
            granted.append(now)
    # The drawn window W, anchored at every grant.
    for i, t in enumerate(granted):
        n = bisect.bisect_right(granted, t + window) - i
        assert n <= (window + burst) * r / NS_PER_S + 1
    # Every window at once: grants i..j lie in [t_i, t_j], so it suffices that
    # j - t_j*r' <= min over i <= j of (i - t_i*r') + burst*r'  (r' = rate per ns).
    per_ns = r / NS_PER_S
    lowest = None
    for j, t in enumerate(granted):
        x = j - t * per_ns
        lowest = x if lowest is None else min(lowest, x)
        assert x <= lowest + burst * per_ns


# -- 3. a greedy user gets the rate -----------------------------------------


@every_store
@SETTINGS
@given(
    rate=rates,
    burst=bursts,
    n_steps=st.integers(2, 120),
    drain=st.booleans(),
    data=st.data(),
)
def test_greedy_user_gets_the_rate_over_every_window(
    make_store: Callable[[CompiledPolicy], BudgetStore],
    rate: str | int | Fraction,
    burst: int,
    n_steps: int,
    drain: bool,
    data: st.DataObject,
) -> None:
    """A user that tries every dt ns (dt <= burst, so it never falls idle) gets
    at least rate*W - 1 and at most (W + burst)*rate + 1 tokens in any window
    [t_a, t_b] of its attempt times. `drain` takes until refused at each step;
    otherwise one attempt per step, which needs dt <= 1/rate to keep up."""
    lim = Limit(rate, burst)
    r = lim.rate
    assert r is not None
    cap = burst if drain else min(burst, int(NS_PER_S / r))
    cap = min(cap, int(5_000 * NS_PER_S / (r * n_steps)) + 1)  # keep the test fast
    dt = data.draw(st.integers(1, cap), label="dt")
    limiter = store_for(make_store, lim)
    b = limiter.pin("u")
    grants = []
    for k in range(n_steps):
        now = 10**12 + k * dt
        n = 0
        while limiter.take(b, now):
            n += 1
            if not drain:
                break
        grants.append(n)
    per_step = dt * r / NS_PER_S
    top = burst * r / NS_PER_S
    # Steps a..b span W = (b - a)*dt: with P the prefix sums,
    # P[b+1] - P[a] >= (b - a)*c - 1  and  <= (b - a)*c + top + 1  (c = dt*rate).
    prefix = 0
    hi_x = lo_x = None
    for k, g in enumerate(grants):
        x = prefix - k * per_step  # P[a] - a*c, for a = k
        hi_x = x if hi_x is None else max(hi_x, x)
        lo_x = x if lo_x is None else min(lo_x, x)
        prefix += g
        y = prefix - k * per_step  # P[b+1] - b*c, for b = k
        assert y >= hi_x - 1
        assert y <= lo_x + top + 1


# -- 4. refunds -------------------------------------------------------------


@every_store
@SETTINGS
@given(
    rate=rates,
    burst=bursts,
    deltas=st.lists(gaps, min_size=1, max_size=80),
    inserts=st.lists(
        st.tuples(st.integers(0, 79), st.integers(0, 2), st.integers(0, 2)),
        max_size=10,
    ),
)
def test_refund_exactly_undoes_a_take(
    make_store: Callable[[CompiledPolicy], BudgetStore],
    rate: str | int | Fraction,
    burst: int,
    deltas: list[int],
    inserts: list[tuple[int, int, int]],
) -> None:
    """Take + refund inserted anywhere (refund at the same instant or later, with
    no other take of that user in between) leaves every later decision as is."""
    lim = Limit(rate, burst)
    times = times_from(10**12, deltas)
    plain, refunded = store_for(make_store, lim), store_for(make_store, lim)
    where = {pos % len(times): rest for pos, *rest in inserts}
    pb, rb = plain.pin("u"), refunded.pin("u")
    prev = times[0]
    for k, t in enumerate(times):
        if k in where:
            take_at, refund_at = where[k]  # thirds of the way to the next request
            t_take = prev + (t - prev) * take_at // 3
            t_refund = t_take + (t - t_take) * refund_at // 2
            if refunded.take(rb, t_take):
                refunded.give_back(rb, t_refund)
        assert plain.take(pb, t) == refunded.take(rb, t)
        assert plain.available(pb, t) == refunded.available(rb, t)
        assert plain.ready_at(pb, t) == refunded.ready_at(rb, t)
        prev = t


@every_store
@SETTINGS
@given(
    rate=rates,
    burst=bursts,
    deltas=st.lists(gaps, max_size=40),
    batches=st.lists(
        st.tuples(gaps, st.integers(0, 1 << 12), st.integers(0, 1 << 12)), min_size=1, max_size=20
    ),
)
def test_take_upto_is_n_takes_at_one_instant(
    make_store: Callable[[CompiledPolicy], BudgetStore],
    rate: str | int | Fraction,
    burst: int,
    deltas: list[int],
    batches: list[tuple[int, int, int]],
) -> None:
    """`take_upto(b, now, n)` takes what n `take`s at `now` back to back
    would, and leaves the state they leave; giving back `m` of them leaves the
    state of n - m takes: every later decision agrees (the scheduler takes a
    user's tokens for a step in one call and gives back what it did not use)."""
    lim = Limit(rate, burst)
    times = times_from(10**12, deltas)
    one, bulk = store_for(make_store, lim), store_for(make_store, lim)
    ob, bb = one.pin("u"), bulk.pin("u")
    for t in times:
        assert one.take(ob, t) == bulk.take(bb, t)
    now = times[-1] if times else 10**12
    for gap, want, unused in batches:
        now += gap
        left = bulk.available(bb, now)
        assert left == one.available(ob, now)
        got = bulk.take_upto(bb, now, want)
        assert got == min(want, left)
        back = min(unused, got)
        for _ in range(got - back):
            assert one.take(ob, now)
        if back:
            bulk.give_back(bb, now, back)
        assert one.available(ob, now) == bulk.available(bb, now)
        assert one.ready_at(ob, now) == bulk.ready_at(bb, now)
        now_s = now * lim.scale  # a TAT in the past is `now`: the same state
        assert max(ob.tat, now_s) == max(bb.tat, now_s)
        spent = [b.credit.spent if b.credit else 0 for b in (ob, bb)]
        assert spent[0] == spent[1]


def test_the_keyed_refund_is_give_back() -> None:
    keyed, direct = limiter_for(Limit(2, NS_PER_S)), limiter_for(Limit(2, NS_PER_S))
    b = direct.bucket("u")
    for t in (0, 0, 0, 10**8):
        assert keyed.try_take("u", t) == direct.take(b, t)
    keyed.refund("u", 10**8)
    direct.give_back(b, 10**8)
    assert keyed.stats("u", 10**8) == direct.stats("u", 10**8)


def test_refund_gives_back_one_token() -> None:
    limiter = limiter_for(Limit(1, NS_PER_S))
    assert limiter.try_take("u", 0) and limiter.try_take("u", 0)
    assert not limiter.try_take("u", 0)
    limiter.refund("u", 0)
    assert limiter.try_take("u", 0)
    assert not limiter.try_take("u", 0)


# -- 5. cleanup -------------------------------------------------------------

USERS = ["a", "b", "c", "d", "e"]
SWAP_POLICIES = [
    policy_of(Limit(10, 100_000_000), a=Limit(2, NS_PER_S), b=Limit(Fraction(1, 3), 10**7)),
    policy_of(Limit(1, 50_000_000), a=Limit(20, NS_PER_S), c=Limit(None, 10**8)),
    policy_of(Limit(None, 100_000_000), b=Limit(5, 10**9)),
]

op = st.one_of(
    st.tuples(st.just("take"), st.sampled_from(USERS), gaps),
    st.tuples(st.just("take_refund"), st.sampled_from(USERS), gaps),
    st.tuples(st.just("pin"), st.sampled_from(USERS), st.just(0)),
    st.tuples(st.just("unpin"), st.sampled_from(USERS), st.just(0)),
    st.tuples(st.just("cleanup"), st.sampled_from(USERS), st.integers(0, 7)),
    st.tuples(st.just("swap"), st.sampled_from(USERS), st.integers(0, len(SWAP_POLICIES) - 1)),
)


@SETTINGS
@given(ops=st.lists(op, max_size=120), budget=st.integers(1, 4))
def test_cleanup_is_invisible(ops: list[tuple[str, str, int]], budget: int) -> None:
    swept = Limiter(SWAP_POLICIES[0], clock=_no_clock)
    twin = Limiter(SWAP_POLICIES[0], clock=_no_clock)
    pins: list[tuple[str, Bucket]] = []
    now = 10**12
    for kind, user, arg in ops:
        if kind in ("take", "take_refund"):
            now += arg
            pinned = [b for u, b in pins if u == user]
            if pinned:
                got = swept.take(pinned[0], now)
            else:
                got = swept.try_take(user, now)
            assert got == twin.try_take(user, now)
            if got and kind == "take_refund":
                swept.refund(user, now)
                twin.refund(user, now)
        elif kind == "pin":
            pins.append((user, swept.pin(user)))
            twin.pin(user)
        elif kind == "unpin":
            for i, (u, b) in enumerate(pins):
                if u == user:
                    swept.unpin(b)
                    del pins[i]
                    break
        elif kind == "cleanup":
            before = len(swept)
            removed = swept.cleanup(now, arg)
            assert 0 <= removed <= arg
            assert len(swept) == before - removed
        else:
            swept.set_policy(SWAP_POLICIES[arg])
            twin.set_policy(SWAP_POLICIES[arg])
        for u, b in pins:  # pinned buckets are never dropped nor replaced
            assert u in swept and swept.bucket(u) is b
        # (cleanup skips its sweep when every bucket is pinned: the count must hold)
        assert swept._pinned == len({id(b) for _, b in pins})
        for u in USERS:
            assert swept.stats(u, now) == twin.stats(u, now)

    # Long after the last take every unpinned user is idle; cleanup, `budget`
    # entries per call, gets down to the pinned ones in one pass over the table.
    now += 10**14
    calls = -(-len(swept) // budget)
    for _ in range(calls):
        assert swept.cleanup(now, budget) <= budget
    assert set(dict(swept.export(now))) == {u for u, _ in pins}
    for u in USERS:
        assert swept.stats(u, now) == twin.stats(u, now)


def test_cleanup_does_bounded_work_and_keeps_busy_users() -> None:
    limiter = limiter_for(Limit(100, 100_000_000))
    for i in range(10_000):
        limiter.bucket(f"user-{i}")
    busy = limiter.pin("busy")
    assert limiter.try_take("debtor", 0)  # not idle until 10ms
    assert limiter.cleanup(0, 64) == 64  # examines 64 entries, not 10_002
    assert len(limiter) == 10_002 - 64
    calls = 1
    while len(limiter) > 2:
        before = len(limiter)
        assert limiter.cleanup(0, 64) == before - len(limiter) <= 64
        calls += 1
    assert calls == -(-10_000 // 64)
    assert set(dict(limiter.export(0))) == {"busy", "debtor"}
    assert limiter.cleanup(0, 64) == 0
    assert limiter.bucket("busy") is busy
    assert limiter.cleanup(10_000_000, 64) == 1  # the debtor is idle now
    assert list(dict(limiter.export(10_000_000))) == ["busy"]
    assert limiter.cleanup(10_000_000, 0) == 0


def test_cleanup_reads_the_injected_clock() -> None:
    clock = [0]
    limiter = Limiter(policy_of(Limit(100, 100_000_000)), clock=lambda: clock[0])
    assert limiter.try_take("u")
    assert limiter.cleanup() == 0
    clock[0] = 10_000_000
    assert limiter.cleanup() == 1
    assert "u" not in limiter


# -- 6. policy swaps carry debt in tokens -------------------------------------

SWAP_RATES = [Fraction(1, 3), Fraction(1, 2), 1, Fraction(5, 2), 10, Fraction(1000, 7), 1000]
FLAG_POLICIES = {r: policy_from_flags(None, {"a": r}) for r in SWAP_RATES}


def _replay(
    make_store: Callable[[CompiledPolicy], BudgetStore], policy: CompiledPolicy, times: list[int]
) -> tuple[BudgetStore, Bucket]:
    store = make_store(policy)
    b = store.pin("a")
    for t in times:
        store.take(b, t)
    return store, b


@every_store
@SETTINGS
@given(
    rates=st.lists(st.sampled_from(SWAP_RATES), min_size=2, max_size=2, unique=True),
    before=st.lists(gaps, max_size=60),
    gap=gaps,
    after=st.lists(gaps, max_size=60),
)
def test_policy_swap_carries_debt_in_tokens(
    make_store: Callable[[CompiledPolicy], BudgetStore],
    rates: list[Fraction | int],
    before: list[int],
    gap: int,
    after: list[int],
) -> None:
    old_rate, new_rate = rates
    old, new = FLAG_POLICIES[old_rate], FLAG_POLICIES[new_rate]
    times = times_from(10**12, before)
    swap_at = (times[-1] if times else 10**12) + gap
    swapped, sb = _replay(make_store, old, times)  # lives through the swap
    stayed, ob = _replay(make_store, old, times)  # what the old policy would do
    swapped.set_policy(new, swap_at)
    fresh, fb = _replay(make_store, new, [])  # a user new at the swap

    assert swapped.limit_of(sb, swap_at) is new.limit_for("a")
    now_ready, old_ready, fresh_ready = (
        s.ready_at(b, swap_at) for s, b in ((swapped, sb), (stayed, ob), (fresh, fb))
    )
    now_left, old_left, fresh_left = (
        s.available(b, swap_at) for s, b in ((swapped, sb), (stayed, ob), (fresh, fb))
    )
    if old_ready > swap_at:
        # The debt beyond the burst, in tokens, is the same under both rates:
        # (ready_old - T + burst) * r_old, up to the old ready's rounding to 1 ns.
        burst, k = new.burst_ns, Fraction(old_rate) / Fraction(new_rate)
        ahead = old_ready - swap_at + burst
        lo = math.ceil(swap_at + (ahead - 1) * k - burst)
        hi = math.ceil(swap_at + ahead * k - burst)
        assert max(lo, swap_at) <= now_ready <= max(hi, swap_at)
    if new_rate > old_rate:  # helps at once
        assert now_ready <= old_ready
        assert now_left >= old_left
    else:  # never more than the old policy now, nor than a fresh user
        assert now_left <= old_left
        assert now_left <= fresh_left
        assert now_ready >= fresh_ready

    later = times_from(swap_at, [0, *after])
    got_swapped = got_stayed = got_fresh = 0
    for t in later:
        got_swapped += swapped.take(sb, t)
        got_stayed += stayed.take(ob, t)
        got_fresh += fresh.take(fb, t)
        if new_rate > old_rate:
            assert got_swapped >= got_stayed
        else:
            assert got_swapped <= got_fresh


def test_policy_swap_converts_debt_exactly() -> None:
    """At 2 tok/s (burst 100ms), takes at 0 and 400ms leave 1.2 tokens of debt
    at 400ms. At 1 tok/s that is 1.2s, at 1/3 tok/s 3.6s, at 1000/7 tok/s 8.4ms;
    the next token comes one burst before the debt is paid."""
    two = policy_from_flags(None, {"a": 2})
    for rate, ready in [
        (1, 1_500_000_000),
        (Fraction(1, 3), 3_900_000_000),
        (Fraction(1000, 7), 0),
    ]:
        limiter = Limiter(two, clock=_no_clock)
        assert limiter.try_take("a", 0) and limiter.try_take("a", 400_000_000)
        assert limiter.ready_at_ns("a", 400_000_000) == 900_000_000
        limiter.set_policy(FLAG_POLICIES[rate])
        assert limiter.ready_at_ns("a", 400_000_000) == max(ready, 400_000_000)


def test_an_idle_users_debt_is_converted_at_the_swap_instant() -> None:
    """Debt 1.2 tokens at 400ms (2 tok/s); the rate drops to 1 tok/s at 400ms:
    1.2s of debt from the swap, next token one burst before it is paid, at
    1.5s, however late the user is touched. (Converting at the touch instead,
    300ms later, would have charged the old rate for those 300ms.)"""
    limiter = Limiter(policy_from_flags(None, {"a": 2}), clock=_no_clock)
    assert limiter.try_take("a", 0) and limiter.try_take("a", 400_000_000)
    limiter.set_policy(FLAG_POLICIES[1], now=400_000_000)
    assert limiter.ready_at_ns("a", 700_000_000) == 1_500_000_000


def test_debt_is_converted_at_each_swap_it_missed() -> None:
    """2 tok/s -> 1 at 400ms -> 1/3 at 600ms, touched only at 1s: 1.2 tokens
    at 400ms, 1.0 token left at 600ms, 3s at 1/3 tok/s, ready at 3.5s."""
    limiter = Limiter(policy_from_flags(None, {"a": 2}), clock=_no_clock)
    assert limiter.try_take("a", 0) and limiter.try_take("a", 400_000_000)
    limiter.set_policy(FLAG_POLICIES[1], now=400_000_000)
    limiter.set_policy(FLAG_POLICIES[Fraction(1, 3)], now=600_000_000)
    assert limiter.ready_at_ns("a", 1_000_000_000) == 3_500_000_000


def test_policy_swap_rounds_debt_against_the_user() -> None:
    """1000/7 tok/s -> 1/3 tok/s one ns after a take: the debt is 1 - 1/7e6 tokens
    = 3s - 428.57ns at the new rate; the next token is due one burst (100ms)
    before, at the first whole ns not earlier than the exact instant."""
    limiter = Limiter(FLAG_POLICIES[Fraction(1000, 7)], clock=_no_clock)
    assert limiter.try_take("a", 0)
    limiter.set_policy(FLAG_POLICIES[Fraction(1, 3)])
    exact = 1 + 3 * NS_PER_S - Fraction(3000, 7) - 100_000_000
    assert limiter.ready_at_ns("a", 1) == math.ceil(exact) == 2_899_999_573
    assert not limiter.try_take("a", 2_899_999_572)
    assert limiter.try_take("a", 2_899_999_573)


def test_unlimited_to_limited_starts_fresh() -> None:
    limiter = Limiter(policy_from_flags(None, {"x": 1}), clock=_no_clock)
    for _ in range(100):
        assert limiter.try_take("a", 0)  # `a` is unlimited by default
    limiter.set_policy(FLAG_POLICIES[1])
    assert limiter.stats("a", 0).remaining == 1
    assert limiter.try_take("a", 0) and not limiter.try_take("a", 0)


# -- 7. stats ---------------------------------------------------------------


@SETTINGS
@given(
    rate=rates,
    burst=bursts,
    deltas=st.lists(gaps, max_size=60),
    gap=gaps,
)
def test_stats_agree_with_take(
    rate: str | int | Fraction, burst: int, deltas: list[int], gap: int
) -> None:
    lim = Limit(rate, burst)
    times = times_from(10**12, deltas)
    now = (times[-1] if times else 10**12) + gap

    def replay() -> Limiter:
        limiter = limiter_for(lim)
        for t in times:
            limiter.try_take("u", t)
        return limiter

    counter, prober = replay(), replay()
    stats = counter.stats("u", now)
    assert stats.limit is lim
    assert stats == prober.stats("u", now) == dict(prober.export(now)).get("u", stats)
    assert (stats.retry_after_ns == 0) == (stats.remaining > 0)
    assert stats.ready_at_ns == now + stats.retry_after_ns
    assert counter.ready_at_ns("u", now) == stats.ready_at_ns
    # remaining == consecutive successful takes at this instant
    for _ in range(stats.remaining):
        assert counter.try_take("u", now)
    assert not counter.try_take("u", now)
    after = counter.stats("u", now)
    assert after.remaining == 0 and after.retry_after_ns > 0
    # at ready_at a take succeeds, one ns before it fails
    for limiter, s in ((prober, stats), (counter, after)):
        if s.ready_at_ns > now:
            assert not limiter.try_take("u", s.ready_at_ns - 1)
        assert limiter.try_take("u", s.ready_at_ns)


@every_store
@SETTINGS
@given(rate=rates, burst=bursts, deltas=st.lists(gaps, max_size=60), gap=gaps)
def test_available_and_ready_at_agree_with_take(
    make_store: Callable[[CompiledPolicy], BudgetStore],
    rate: str | int | Fraction,
    burst: int,
    deltas: list[int],
    gap: int,
) -> None:
    """`available` is the number of takes that succeed back to back now;
    `ready_at` is the first instant a take succeeds (now if it does)."""
    store = store_for(make_store, Limit(rate, burst))
    b = store.pin("u")
    times = times_from(10**12, deltas)
    for t in times:
        store.take(b, t)
    now = (times[-1] if times else 10**12) + gap
    ready = store.ready_at(b, now)
    left = store.available(b, now)
    assert (ready == now) == (left > 0)
    for _ in range(left):
        assert store.take(b, now)
    assert not store.take(b, now)
    again = store.ready_at(b, now)
    assert again > now and store.available(b, now) == 0
    assert not store.take(b, again - 1)
    assert store.take(b, again)


def test_stats_of_a_fresh_user() -> None:
    limiter = limiter_for(Limit(10, 250_000_000))  # 2.5 tokens of burst: 3 at once
    s = limiter.stats("new", 5)
    assert (s.remaining, s.retry_after_ns, s.ready_at_ns) == (3, 0, 5)
    assert "new" not in limiter  # asking does not create state
    assert limiter.ready_at_ns("new", 5) == 5


# -- 8. unlimited users and the anonymous budget -------------------------------


def test_unlimited_users_always_succeed() -> None:
    limiter = Limiter(policy_from_flags(None, {"a": 5}), clock=_no_clock)
    b = limiter.bucket("someone")
    assert all(limiter.take(b, 0) for _ in range(10_000))
    assert limiter.available(b, 0) >= 1 << 30
    assert limiter.ready_at(b, 0) == 0
    s = limiter.stats("someone", 0)
    assert (s.remaining, s.retry_after_ns, s.ready_at_ns) == (-1, 0, 0)
    assert s.limit.unlimited
    limiter.give_back(b, 0)
    assert limiter.take(b, 0)


def test_anonymous_requests_share_the_anonymous_limit() -> None:
    text = "version: 1\ndefault: unlimited\nanonymous: 2\nburst: 1s\nusers: {alice: 1}\n"
    policy = compile_policy(parse_policy(text, "anon.yaml"), "anon.yaml")
    limiter = Limiter(policy, clock=_no_clock)
    assert limiter.stats(ANONYMOUS, 0).limit is policy.anonymous
    assert limiter.stats(ANONYMOUS, 0).remaining == 3  # 1s at 2/s, plus one
    assert [limiter.try_take(ANONYMOUS, 0) for _ in range(4)] == [True, True, True, False]
    assert limiter.try_take(ANONYMOUS, 500_000_000)
    assert limiter.stats("alice", 0).limit is policy.users["alice"]
    assert limiter.stats("bob", 0).limit.unlimited


def test_flags_without_default_leave_anonymous_unlimited() -> None:
    limiter = Limiter(policy_from_flags(None, {"a": 1}), clock=_no_clock)
    assert all(limiter.try_take(ANONYMOUS, 0) for _ in range(1000))


# -- 9. export ---------------------------------------------------------------


def test_export_yields_stats_for_every_known_user() -> None:
    limiter = Limiter(policy_from_flags(1, {"fast": 100, "free": "unlimited"}), clock=_no_clock)
    for u in ["fast", "free", "slow", ANONYMOUS]:
        limiter.try_take(u, 0)
    limiter.pin("pinned-only")
    exported = dict(limiter.export(50_000_000))
    assert set(exported) == {"fast", "free", "slow", ANONYMOUS, "pinned-only"}
    for user, stats in exported.items():
        assert stats == limiter.stats(user, 50_000_000)
    assert exported["free"].remaining == -1
    assert exported["fast"].remaining == 11  # idle again after 10ms: 10 tokens of burst + 1
    assert exported["slow"].remaining == 0
    assert dict(Limiter(policy_from_flags(1, None), clock=_no_clock).export(0)) == {}


# -- the benchmark script does not rot ----------------------------------------


def _bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The script as a module. Its gc.collect() before each timed loop is for
    the numbers, not the verdicts these tests check: in the test process
    (vLLM, hypothesis, a thousand tests' objects) each full collection takes
    about half a second, 36 of them a run, so it is skipped here."""
    spec = importlib.util.spec_from_file_location("bench_limiter", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.gc, "collect", lambda: 0)
    return bench


def test_benchmark_script_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _bench(monkeypatch).main(["--quick", "--users", "2000", "--iterations", "20000"]) == 0
    out = capsys.readouterr().out
    for row in ["try_take", "take (bucket)", "bytes per idle user", "cleanup(now, 64)", "<= 250 B"]:
        assert row in out


def test_benchmark_check_fails_on_a_missed_target(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = _bench(monkeypatch)
    monkeypatch.setattr(bench, "TARGET_IDLE_BYTES", 1)
    tiny = ["--users", "100", "--iterations", "1000", "--quick"]
    assert bench.main(tiny) == 0  # a report by default
    assert bench.main([*tiny, "--check"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "(--check: exit 1)" in out


# -- borrowing: the excess bucket of a rule with a peak (issue 33) ------------


def test_borrowed_tokens_come_from_the_excess_bucket_alone():
    """Committed takes and borrows are two buckets: borrowing at the excess
    rate (peak - rate) leaves the committed budget untouched, and a rule
    without a peak never borrows."""
    lim = Limit(20, 100_000_000, peak=100)  # excess: 80 tok/s, 100 ms burst
    lim_flat = Limit(20, 100_000_000)
    t = limiter_for(lim)
    b = t.pin("u")
    now = 10 * NS_PER_S
    committed = t.take_upto(b, now, 1000)  # the committed burst: 3 tokens
    borrowed = 0
    while t.borrow(b, now):
        borrowed += 1
    assert (committed, borrowed) == (3, 9)  # 80 tok/s x 100 ms + 1
    assert not t.can_borrow(b, now) and t.available(b, now) == 0
    later = now + NS_PER_S  # one second on: each bucket refilled at its own rate
    assert t.available(b, later) == 3
    t.give_back_borrowed(b, now)
    assert t.can_borrow(b, now)
    flat = limiter_for(lim_flat)
    assert not flat.can_borrow(flat.pin("u"), now) and not flat.borrow(flat.pin("u"), now)


def test_borrow_ready_at_is_when_the_excess_bucket_lends_again():
    """`borrow_ready_at` is `ready_at` for the excess bucket: `now` while it
    lends, else the first instant `can_borrow` says yes; None without a peak."""
    t = limiter_for(Limit(20, 100_000_000, peak=100))  # excess: 80 tok/s
    b = t.pin("u")
    now = 10 * NS_PER_S
    assert t.borrow_ready_at(b, now) == now
    while t.borrow(b, now):
        pass
    ready = t.borrow_ready_at(b, now)
    assert ready is not None and now < ready <= now + NS_PER_S // 80
    assert not t.can_borrow(b, ready - 1) and t.can_borrow(b, ready)
    assert t.ready_at(b, now) == now  # the committed bucket: untouched, its own time
    flat = limiter_for(Limit(20, 100_000_000))
    assert flat.borrow_ready_at(flat.pin("u"), now) is None
    free = limiter_for(Limit(20, 100_000_000, peak="unlimited"))
    assert free.borrow_ready_at(free.pin("u"), now) == now


def test_an_unlimited_peak_borrows_without_a_cap():
    t = limiter_for(Limit(20, 100_000_000, peak="unlimited"))
    b = t.pin("u")
    assert all(t.borrow(b, NS_PER_S) for _ in range(10_000))
    assert t.take_upto(b, NS_PER_S, 100) == 3  # the committed budget is untouched
