"""Per-user and per-request bookkeeping of the rate-limited scheduler.

Plain slotted records, no vLLM behaviour: the scheduler (scheduler.py) owns
every decision. Kept apart so that file reads as the algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outrate.budget.limiter import Bucket
from outrate.observe.metrics import LabelMetrics
from outrate.policy.compiler import CompiledPolicy

if TYPE_CHECKING:
    from vllm.v1.request import Request

ATTR = "_outrate"
"""Our state on vLLM's Request objects (Request has no __slots__). The
scheduler's per-token hook reads it as `request._outrate` (an attribute load is
about 3x cheaper than `request.__dict__[ATTR]`); everything else goes through
ATTR."""


class PolicyBox:
    """The one reference the scheduler reads per step; reloads replace it."""

    __slots__ = ("current",)

    def __init__(self, policy: CompiledPolicy) -> None:
        self.current = policy


class UserState:
    """A user with live requests in this scheduler."""

    # Slots in the order the per-token hook reads them: one object's fields
    # a step touches sit in as few cache lines as possible.
    __slots__ = (
        "left",
        "step",
        "resident",
        "n_held",
        "bucket",
        "refused_step",
        "m",
        "key",
        "live",
        "held",
        "ready_at",
        "armed",
        "n_borrowing",
        "served",
        "pbucket",
        "n_prompt_waiting",
        "pshort_step",
        "pserved",
    )

    def __init__(self, key: str, bucket: Bucket, m: LabelMetrics) -> None:
        self.key = key
        self.bucket = bucket
        self.live = 0  # requests not finished
        self.resident = 0  # requests holding a running slot (visible or held)
        self.n_held = 0
        self.held: list[tuple[int, int, Request]] = []  # heap (priority, seq, req)
        self.refused_step = -1
        self.ready_at = 0
        self.armed = False  # has a live entry in the wake heap
        self.m = m  # the metrics record of this user's `limit` label
        self.step = -1  # the last step it was granted tokens in
        # This step's tokens: the user's first charge in a step takes from the
        # store as many as it has visible running requests (`take_upto`);
        # each charge spends one; what is left goes back at the step's end.
        self.left = 0  # tokens taken for this step and not spent yet
        # Borrowing (lending.py): its requests running on spare capacity, and
        # its borrowed service in seconds of its committed rate (tokens/rate),
        # the counter spare capacity is shared by (VTC's).
        self.n_borrowing = 0
        self.served = 0.0
        self.pbucket: Bucket | None = None  # its prompt budget (prompts.py), once pinned
        self.n_prompt_waiting = 0  # its requests waiting for prompt budget (a reload moves them)
        self.pshort_step = -2  # the last step its prompt budget fell short (lending.py)
        self.pserved = 0.0  # borrowed prompt service, seconds of its prompt rate (prompts.py)

    def wakes_at(self, ready: int) -> bool:
        """Whether a wake-heap entry for `ready` is this user's live one."""
        return self.armed and ready == self.ready_at


class RequestState:
    __slots__ = (  # the hook's first (see UserState)
        "charged_step",
        "user",
        "resident",
        "held",
        "preempted_step",
        "held_since",
        "last_ns",
        "prev_ns",
        "over_step",
        "deferred",
        "borrowing",
        "borrowed_step",
        "prompt_done",
        "prompt_step",
        "prompt_prev",
        "prompt_taken",
        "prompt_counted",
        "prompt_borrowed",
        "prompt_waiting",
    )

    def __init__(self, user: UserState) -> None:
        self.user = user
        self.resident = False
        self.held = False
        self.charged_step = -1
        self.preempted_step = -1
        # Token intervals (ledger.py): each charge observes the time since the
        # request's last token; a refund puts the one before back.
        self.last_ns = 0  # its last charged token's step time (0: none yet)
        self.prev_ns = 0  # ... and the one before (what a refund restores)
        self.held_since = 0
        self.over_step = -1  # step of a shadow over-limit charge (refunds)
        self.deferred = ""  # why admission is deferred now ("" when it is not)
        self.borrowing = False  # running on spare capacity, out of its committed budget
        self.borrowed_step = -1  # step of a borrowed charge (refunds, the trace)
        # Prompt charges (prompts.py): positions below `prompt_done` were
        # charged once (recomputation is free); this step's charge, for refunds.
        self.prompt_done = 0
        self.prompt_step = -1  # the step of its last prompt charge
        self.prompt_prev = 0  # prompt_done before that step
        self.prompt_taken = 0  # tokens taken from the prompt budget that step
        self.prompt_counted = 0  # tokens counted that step (shadow: beyond the taken)
        self.prompt_borrowed = 0  # of those, borrowed (prompt `peak`: spare step time)
        # Waiting for prompt budget (prompts.py): from a step that found none
        # for its next prompt position until one that charges it some.
        self.prompt_waiting = False


def is_held(request: Request) -> bool:
    """Whether a user's held-heap entry still stands for a held request
    (entries of finished, preempted or released requests are skipped lazily)."""
    rs = request.__dict__.get(ATTR)
    return rs is not None and rs.held


def end_prompt_wait(rs: RequestState) -> None:
    """`rs` no longer waits for prompt budget: it was charged prompt tokens,
    admitted, deferred for another reason, finished, or prompts are no
    longer limited. O(1); nothing when it was not waiting."""
    if rs.prompt_waiting:
        rs.prompt_waiting = False
        u = rs.user
        u.n_prompt_waiting -= 1
        u.m.prompt_waiting -= 1


class StepScratch:
    """Everything one `schedule()` call collects for its end (`_after_schedule`);
    emptied there. One record, so what a step carries is in one place."""

    __slots__ = (
        "last_charge",
        "preempted_charged",
        "refused",
        "touched",
        "admits",
        "stash",
        "blocked_ready",
        "users",
        "borrow_slots",
        "borrow_tokens",
        "borrow_quota",
        "borrow_timed",
        "prefill_granted",
        "deferrals",
    )

    def __init__(self) -> None:
        # Refund candidates: a charged request can miss the step only if it was
        # preempted afterwards, or if its KV allocation failed without that:
        # in the waiting loop, which stops there (the running loop preempts
        # the request itself unless a KV connector defers frees, and the
        # engine refuses connectors). So the last one charged, and those
        # preempted after their charge.
        self.last_charge: Request | None = None
        self.preempted_charged: list[Request] = []
        self.refused: list[Request] = []  # resident requests refused a token
        self.touched: list[UserState] = []  # users refused: (re)armed after the step
        self.admits: list[Request] = []  # counted resident before stock admitted them
        self.stash: list[Request] = []  # held victims preempted mid-loop, requeued after
        self.blocked_ready = 0  # earliest ready time of a user blocking admission
        self.users: list[UserState] = []  # users granted more than one token (fold)
        # What this step may still lend to borrowers' waiting requests (lending.py).
        self.borrow_slots = 0
        self.borrow_tokens = 0
        self.borrow_quota: dict[UserState, int] = {}  # per user: its share left for new prompts
        self.borrow_timed = False  # borrow_tokens is bounded by step time too (running prefills)
        self.prefill_granted = 0  # tokens of running prefill chunks this step (prompts.py)
        # Requests deferred for max_streams or budget (not by a peak's
        # lending) or parked this step: the next step parks only after one
        # that had some (parking.py). Set at a step's start.
        self.deferrals = 0

    def blocked_until(self, ready: int) -> None:
        """A user blocking admission is ready at `ready`: the engine's idle
        wait ends at the earliest such time (`blocked_ready`)."""
        if self.blocked_ready == 0 or ready < self.blocked_ready:
            self.blocked_ready = ready
