"""A Limiter lent by a SharedBudget, the scheduler's side, without a store:
the same decisions as Limiter, credit spent and handed back, the lease
thread's mode applied at step boundaries only, and what each fallback mode
paces a user at."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_support import MS, S, policy, settle

from outrate.budget.limiter import Limiter
from outrate.budget.shared.credit import Mode, SharedBudget, credit_of, fallback_named


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "back", "ready", "avail"]), st.integers(0, 60 * MS)),
        max_size=80,
    ),
    st.sampled_from(["share", "full"]),
)
def test_without_a_store_the_decisions_are_the_limiters(ops, fallback):
    """Never connected and one engine: the lent table is Limiter, verb for verb."""
    pol = policy()
    a, b = Limiter(pol), Limiter(pol, lender=SharedBudget(fallback=fallback))
    ba, bb = a.pin("alice"), b.pin("alice")
    now = 10 * S
    taken = 0
    for op, gap in ops:
        now += gap
        if op == "take":
            r = a.take(ba, now)
            assert b.take(bb, now) == r
            taken += r
        elif op == "back" and taken:
            a.give_back(ba, now)
            b.give_back(bb, now)
            taken -= 1
        elif op == "ready":
            assert a.ready_at(ba, now) == b.ready_at(bb, now)
        else:
            assert a.available(ba, now) == b.available(bb, now)


def test_credit_is_spent_given_back_and_never_overdrawn():
    budget = SharedBudget()
    lim = Limiter(policy(), lender=budget)
    budget.mode = Mode(shared=True)  # (as the lease thread publishes it)
    settle(lim)
    b = lim.pin("alice")
    c = credit_of(b)
    now = 10 * S
    assert not lim.take(b, now)  # no credit yet
    assert lim.available(b, now) == 0 and lim.ready_at(b, now) > now
    c.granted += 2
    assert lim.available(b, now) == 2
    assert lim.take(b, now) and lim.take(b, now)
    assert not lim.take(b, now)  # the local burst has room; the credit has none
    lim.give_back(b, now)
    assert c.held == 1 and lim.take(b, now)
    c.granted += 2
    now += S  # the local burst is back: 3 tokens; the credit holds 2
    assert lim.take_upto(b, now, 10) == 2 and c.held == 0  # a bulk take stops at the credit
    lim.give_back(b, now, 2)
    assert c.held == 2 and lim.available(b, now) == 2
    bob = lim.pin("nobody")  # unlimited users never need credit
    assert all(lim.take(bob, now) for _ in range(100))
    lim.unpin(b)  # the user's last request left: its credit is handed back
    assert c.held == 0 and c.released == 2


def test_the_mode_is_applied_at_a_step_boundary_only():
    """The lease thread's record takes effect at the next pin or cleanup,
    never inside a step: a take between publishing and the boundary still
    decides in the mode it started the step in."""
    budget = SharedBudget(engines_hint=2)
    lim = Limiter(policy(), lender=budget)
    b = lim.pin("alice")
    now = 10 * S
    assert lim.limit_of(b, now).rate == 10  # the fallback: rate/2
    budget.mode = Mode(shared=True, n=2)
    assert lim.take(b, now)  # still local: no credit needed
    settle(lim)
    assert budget.applied == budget.mode and lim.limit_of(b, now).rate == 20
    assert not lim.take(b, now)  # shared now: no credit yet
    credit_of(b).share = Fraction(1, 4)  # as the lease thread writes a new share...
    budget.reshare.append(b)  # ...and hands the bucket over
    assert lim.limit_of(b, now).rate == 20
    settle(lim)
    assert lim.limit_of(b, now).rate == 5


def test_fallback_names_and_what_each_paces_a_user_at():
    """local (the default) and pause pace a user at rate/N, at most its last
    share, while the store is away; full at the full rate. `share` is the old
    name of pause; an unknown name is refused."""
    assert fallback_named(None) == ("local", None)
    assert fallback_named("share")[0] == "pause" and "deprecated" in (
        fallback_named("share")[1] or ""
    )
    with pytest.raises(ValueError, match="must be one of local, pause, full, got 'x'"):
        fallback_named("x")
    now = 10 * S
    for name, rate in (("local", 10), ("pause", 10), ("share", 10), ("full", 20)):
        budget = SharedBudget(fallback=name, engines_hint=2)
        lim = Limiter(policy(), lender=budget)
        b = lim.pin("alice")
        assert lim.limit_of(b, now).rate == rate, name
        credit_of(b).share = Fraction(1, 4)  # its last share, smaller than 1/N
        budget.mode = Mode(shared=False, n=2)
        settle(lim)
        lim.stale(b)
        assert lim.limit_of(b, now).rate == (5 if name != "full" else 20), name
