"""What one step did, per user, for the token trace (`--outrate-trace`).

One `StepRecorder` is handed to the holdback (holds, releases) and the ledger
(refunds); the scheduler writes the step's line from it at the step's end
(`write`), which also starts the next step's counts. Only exists while
tracing. Plain Python: no vLLM import.
"""

from __future__ import annotations

from typing import Any

from vllm_integration.step.state import ATTR


class StepRecorder:
    __slots__ = ("trace", "held_by", "released_by", "refunded_by", "arrived_by", "pwait_by")

    def __init__(self, trace: Any) -> None:
        self.trace = trace  # a TraceWriter
        self.arrived_by: dict[str, int] = {}
        self.held_by: dict[str, int] = {}
        self.released_by: dict[str, int] = {}
        self.refunded_by: dict[str, int] = {}
        self.pwait_by: dict[str, int] = {}

    def arrived(self, key: str) -> None:
        self.arrived_by[key] = self.arrived_by.get(key, 0) + 1

    def held(self, key: str) -> None:
        self.held_by[key] = self.held_by.get(key, 0) + 1

    def released(self, key: str, n: int) -> None:
        self.released_by[key] = self.released_by.get(key, 0) + n

    def refunded(self, key: str) -> None:
        self.refunded_by[key] = self.refunded_by.get(key, 0) + 1

    def prompt_waited(self, key: str) -> None:
        self.pwait_by[key] = self.pwait_by.get(key, 0) + 1

    def event(self, now: int, **fields: Any) -> None:
        """A line that is not a step (a policy swap)."""
        self.trace.event(now, **fields)

    def write(
        self,
        scheduled: dict[str, int],
        requests: dict[str, Any],
        step: int,
        now: int,
        running: int,
        predicted_us: int = 0,
        per_seq_us: int = 0,
    ) -> None:
        """The step's line: the requests stock's loop visited (`running`: held
        ones are not among them); per user id, tokens charged this step
        (gross), refunded, shadow over-limit, borrowed (between rate and peak:
        already among the charged) and first tokens of a request; held,
        released, and requests that arrived since the step before; prompt
        tokens charged (net: the refund point ran, and refunded requests are
        not scheduled), of those the ones over a shadow prompt limit,
        requests that found no prompt budget, and prompt tokens borrowed
        (past the prompt rate, under its peak: among the prompt ones); and
        the step's predicted length where the step model runs
        (`StepCost.dispatched`), with the model's cost of one more request
        (what lending priced a borrower at). O(requests scheduled). Steps where nothing
        happened write nothing."""
        charged: dict[str, int] = {}
        over: dict[str, int] = {}
        borrowed: dict[str, int] = {}
        first: dict[str, int] = {}
        prompt: dict[str, int] = {}
        prompt_over: dict[str, int] = {}
        prompt_borrowed: dict[str, int] = {}
        for rid in scheduled:
            rs = requests[rid].__dict__.get(ATTR)
            if rs is None:
                continue
            if rs.prompt_step == step and rs.prompt_counted:
                pkey = rs.user.key
                prompt[pkey] = prompt.get(pkey, 0) + rs.prompt_counted
                n_over = rs.prompt_counted - rs.prompt_taken - rs.prompt_borrowed
                if n_over:  # shadow: counted beyond its budget
                    prompt_over[pkey] = prompt_over.get(pkey, 0) + n_over
                if rs.prompt_borrowed:
                    n = rs.prompt_borrowed
                    prompt_borrowed[pkey] = prompt_borrowed.get(pkey, 0) + n
            if rs.charged_step != step:
                continue
            key = rs.user.key
            charged[key] = charged.get(key, 0) + 1
            if rs.over_step == step:
                over[key] = over.get(key, 0) + 1
            if rs.borrowed_step == step:
                borrowed[key] = borrowed.get(key, 0) + 1
            if not rs.prev_ns:  # no token before this one: the request's first
                first[key] = first.get(key, 0) + 1
        refunded = self.refunded_by
        for key, n in refunded.items():
            charged[key] = charged.get(key, 0) + n
        held, released, arrived = self.held_by, self.released_by, self.arrived_by
        pwait = self.pwait_by
        if charged or held or released or arrived or prompt or pwait:  # (the writer keeps them)
            self.trace.step(
                (
                    now,
                    step,
                    running,
                    charged,
                    refunded,
                    held,
                    released,
                    over,
                    borrowed,
                    first,
                    arrived,
                    prompt,
                    prompt_over,
                    pwait,
                    prompt_borrowed,
                    predicted_us,
                    per_seq_us,
                )
            )
            self.held_by, self.released_by, self.refunded_by = {}, {}, {}
            self.arrived_by, self.pwait_by = {}, {}
