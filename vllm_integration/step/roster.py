"""The users with live requests in one scheduler, and each request's record.

A user appears with its first live request (its bucket pinned in the store,
its metrics label resolved) and goes with its last (unpinned, so the store may
forget it once idle). Plain Python over the records of state.py: no vLLM
import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outrate.budget.limiter import Limiter
from outrate.budget.store import BudgetStore
from outrate.observe.metrics import Metrics
from outrate.policy.compiler import CompiledPolicy
from vllm_integration.step.state import ATTR, RequestState, UserState, end_prompt_wait

if TYPE_CHECKING:
    from vllm.v1.request import Request


class Roster:
    def __init__(
        self, limiter: BudgetStore, metrics: Metrics, prompts: Limiter | None = None
    ) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.prompts = prompts  # the prompt budgets' table (prompts.py)
        self.users: dict[str, UserState] = {}

    def user(self, key: str, policy: CompiledPolicy) -> UserState:
        u = self.users.get(key)
        if u is None:
            label = self.metrics.label_of(key, policy)
            u = UserState(key, self.limiter.pin(key), self.metrics.record(label))
            if self.prompts is not None:
                u.pbucket = self.prompts.pin(key)
            self.users[key] = u
        return u

    def register(
        self, request: Request, key: str, policy: CompiledPolicy, running: bool
    ) -> RequestState:
        """A new live request of user `key` (`running`: it already holds a slot)."""
        u = self.user(key, policy)
        u.live += 1
        u.m.live += 1
        rs = RequestState(u)
        if running:
            rs.resident = True
            u.resident += 1
        request.__dict__[ATTR] = rs
        return rs

    def finish(self, rs: RequestState) -> None:
        """A request is gone (its slot already left): the user goes with its last."""
        end_prompt_wait(rs)
        u = rs.user
        u.live -= 1
        u.m.live -= 1
        if u.live == 0:
            del self.users[u.key]
            self.limiter.unpin(u.bucket)
            if u.pbucket is not None and self.prompts is not None:
                self.prompts.unpin(u.pbucket)

    def charged(self) -> int:
        """Tokens charged so far, net of refunds: every label's counter."""
        return sum(m.tokens for m in self.metrics.labels.values())
