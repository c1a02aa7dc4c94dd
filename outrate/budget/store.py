"""The budget store protocol: what the scheduler needs from per-user state.

The scheduler (vllm_integration/step/scheduler.py) only talks to a `BudgetStore`.
`outrate.budget.limiter.Limiter` is the implementation: in memory for one
engine, or lent credit by a budget shared between engines
(outrate.budget.shared.credit.SharedBudget), and the scheduler does not
change. Decisions must be O(1), allocation-free and never wait on I/O: a
shared store decides from state held in memory and refreshes it off the
scheduler's thread. The property tests (tests/test_limiter.py) run against
every store.

A `Bucket` is the handle a live request keeps for its user (`pin`/`unpin`);
outside the store, read only its `key`, `pins` and `limit`. `now` is the
scheduler's step time in ns (CLOCK_MONOTONIC or a test's clock). `pin` and
`cleanup` are step boundaries: call them between steps (requests arrive,
a step ends), never inside one.
"""

from __future__ import annotations

from typing import Protocol

from outrate.budget.limiter import Bucket, Limit, LimitSource


class BudgetStore(Protocol):
    @property
    def policy(self) -> LimitSource: ...

    def set_policy(self, policy: LimitSource, now: int | None = None) -> None:
        """Swap the policy at `now`; each user's debt carries over in tokens."""

    def pin(self, user: str) -> Bucket:
        """The user's bucket, kept alive until every pin is `unpin`ned."""

    def unpin(self, b: Bucket) -> None: ...

    def take(self, b: Bucket, now: int) -> bool:
        """Take one token if it conforms: `take_upto(b, now, 1) == 1`, the
        decision the other verbs are defined by (for tools and tests)."""

    def take_upto(self, b: Bucket, now: int, n: int) -> int:
        """Take up to `n` tokens at `now`: what `n` `take`s at `now` back to
        back would take, in one call; returns how many. The hot path: one
        call per user and step, O(1), no I/O."""

    def give_back(self, b: Bucket, now: int, n: int = 1) -> None:
        """Undo `n` tokens of successful takes (the scheduler's one refund
        point, and a step's unused tokens)."""

    def ready_at(self, b: Bucket, now: int) -> int:
        """Earliest time `take` can succeed; `now` if it can now."""

    def available(self, b: Bucket, now: int) -> int:
        """Tokens `take` would grant back to back at `now`."""

    def can_borrow(self, b: Bucket, now: int) -> bool:
        """Whether the user's peak lets it borrow a token at `now` (its excess
        bucket: `Limit.excess`); False without a peak."""

    def borrow(self, b: Bucket, now: int) -> bool:
        """Take one borrowed token from the excess bucket alone (the committed
        bucket is untouched: borrowing leaves it no debt)."""

    def borrow_upto(self, b: Bucket, now: int, n: int) -> int:
        """Take up to `n` borrowed tokens (`borrow` `n` times back to back)."""

    def borrowable(self, b: Bucket, now: int) -> int:
        """Borrowed tokens `borrow` would grant back to back at `now`."""

    def give_back_borrowed(self, b: Bucket, now: int, n: int = 1) -> None:
        """Undo `n` borrowed tokens (the refund point)."""

    def limit_of(self, b: Bucket, now: int) -> Limit:
        """The limit in force for the bucket's user."""

    def cleanup(self, now: int | None = None, budget: int = 64) -> int:
        """Forget up to `budget` idle, unpinned users; bounded work per call.
        Called at the end of every step."""
