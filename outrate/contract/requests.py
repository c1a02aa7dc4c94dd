"""The request rate (`requests:` on any rule), decided in the API server
before the request is parsed, tokenized or sent to the engine.

One `RequestTable` per API-server process: the in-memory `Limiter`
(outrate.budget.limiter) over the compiled policy's request rates
(`CompiledPolicy.requests`), so the decision is the same `gcra()` every
token of the engine goes through, and a reload carries each user's debt
over in requests as it carries token debt. Each request asks for one token
of its user's request bucket: it conforms (go on) or it does not (HTTP 429).

With `--api-server-count N` each API-server process keeps its own table:
a user whose connections land on k of them gets up to k times its rate
(docs/client-contract.md states the bound). Only the event loop's thread
calls a table; the clock is injected so tests never sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from outrate.budget.limiter import Limit, Limiter
from outrate.policy.compiler import UNLIMITED_REQUESTS, CompiledPolicy

CLEANUP_BUDGET = 8
"""Idle users examined per request: the table stays as large as the users
seen within about one burst, whatever ids clients send."""


class Admission(NamedTuple):
    """One request's decision, and what its rate-limit headers say."""

    admitted: bool
    """False: refuse it (429)."""
    limit: Limit
    """The request rate in force for the user (`rate` None: unlimited)."""
    remaining: int
    """Requests admitted now, back to back, after this one; -1 when unlimited."""
    retry_after_ns: int
    """0 when admitted; else how long until one request conforms."""
    reset_ns: int
    """How long until the user's whole allowance is back."""
    over: bool = False
    """Over the rate: refused, or (a rule in shadow) counted and admitted."""


UNLIMITED = Admission(True, UNLIMITED_REQUESTS, -1, 0, 0)


class RequestTable:
    """Each user's request bucket, in one API-server process."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.clock = clock
        self._table: Limiter | None = None
        self._policy: CompiledPolicy | None = None

    def admit(self, policy: CompiledPolicy, user: str, now: int | None = None) -> Admission:
        """Take one request from `user`'s bucket under `policy` (the policy in
        force at this request's admission; a newer one swaps in here)."""
        if now is None:
            now = self.clock()
        table = self._table
        if table is None:
            table = self._table = Limiter(policy.requests, clock=self.clock)
            self._policy = policy
        elif policy is not self._policy:
            table.set_policy(policy.requests, now)
            self._policy = policy
        if policy.requests.limit_for(user).rate is None and user not in table:
            return UNLIMITED  # no state for the unlimited
        b = table.bucket(user)
        lim = table.limit_of(b, now)
        if lim.rate is None:
            return UNLIMITED
        admitted = table.take(b, now)
        if admitted:
            decision = Admission(True, lim, table.available(b, now), 0, 0)
        elif lim.shadow:  # counted, not enforced: the bucket does not move
            decision = Admission(True, lim, 0, 0, 0, over=True)
        else:
            decision = Admission(False, lim, 0, table.ready_at(b, now) - now, 0, over=True)
        decision = decision._replace(reset_ns=table.full_at(b, now) - now)
        table.cleanup(now, CLEANUP_BUDGET)
        return decision

    def __len__(self) -> int:
        return 0 if self._table is None else len(self._table)
