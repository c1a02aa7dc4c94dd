"""Per-user and per-request bookkeeping of the rate-limited scheduler.

Plain slotted records, no vLLM behaviour: the scheduler (scheduler.py) owns
every decision. Kept apart so that file reads as the algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outrate.compiler import CompiledPolicy
from outrate.limiter import Bucket

if TYPE_CHECKING:
    from vllm.v1.request import Request

ATTR = "_outrate"
"""Our state on vLLM's Request objects (Request has no __slots__)."""


class PolicyBox:
    """The one reference the scheduler reads per step; reloads replace it."""

    __slots__ = ("current",)

    def __init__(self, policy: CompiledPolicy) -> None:
        self.current = policy


class UserState:
    """A user with live requests in this scheduler."""

    __slots__ = (
        "key",
        "bucket",
        "live",
        "resident",
        "n_held",
        "held",
        "refused_step",
        "ready_at",
        "armed",
    )

    def __init__(self, key: str, bucket: Bucket) -> None:
        self.key = key
        self.bucket = bucket
        self.live = 0  # requests not finished
        self.resident = 0  # requests holding a running slot (visible or held)
        self.n_held = 0
        self.held: list[tuple[int, int, Request]] = []  # heap (priority, seq, req)
        self.refused_step = -1
        self.ready_at = 0
        self.armed = False  # has a live entry in the wake heap

    def wakes_at(self, ready: int) -> bool:
        """Whether a wake-heap entry for `ready` is this user's live one."""
        return self.armed and ready == self.ready_at


class RequestState:
    __slots__ = ("user", "resident", "held", "charged_step", "preempted_step")

    def __init__(self, user: UserState) -> None:
        self.user = user
        self.resident = False
        self.held = False
        self.charged_step = -1
        self.preempted_step = -1


def is_held(request: Request) -> bool:
    """Whether a user's held-heap entry still stands for a held request
    (entries of finished, preempted or released requests are skipped lazily)."""
    rs = request.__dict__.get(ATTR)
    return rs is not None and rs.held
