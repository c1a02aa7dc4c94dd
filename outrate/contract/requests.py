"""The request rate (`requests:` on any rule), decided in the API server
before the request is parsed, tokenized or sent to the engine.

One `RequestTable` per API-server process: the in-memory `Limiter`
(outrate.budget.limiter) over the compiled policy's request rates
(`CompiledPolicy.requests`), so the decision is the same `gcra()` every
token of the engine goes through, and a reload carries each user's debt
over in requests as it carries token debt. Each request asks for one token
of its user's request bucket: it conforms (go on) or it does not (HTTP 429).

With `--api-server-count N` each API-server process keeps its own table:
without a store a user whose connections land on k of them gets up to k
times its rate (docs/client-contract.md states the bound). With
`--outrate-store` the table is lent by a `SharedBudget` (`lender`): each API
server's lease thread (outrate.budget.shared.runner, kind `REQUESTS`) leases
request credit from one global GCRA per user, exactly as engines lease
tokens, and a request must fit the local GCRA (at this process's share)
and the credit held. A user is pinned (its demand registered) from its
first request until it has sent none for `IDLE_NS`. A refusal only for want
of credit not yet arrived (a user's first request here) says how long to
wait for it (`Admission.pending_ns`): the middleware waits that long and
asks again while it is on its way (`admit_waiting`), up to `MAX_WAIT_NS` in
all, instead of refusing. Only the event loop's thread calls a table; the
clock is injected so tests never sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from outrate.budget.gcra import NS_PER_S
from outrate.budget.limiter import Bucket, Lender, Limit, Limiter
from outrate.policy.compiler import UNLIMITED_REQUESTS, CompiledPolicy

CLEANUP_BUDGET = 8
"""Idle users examined per request: the table stays as large as the users
seen within about one burst, whatever ids clients send."""
IDLE_NS = 2_000_000_000
"""With a store: a user's demand stays registered (its bucket pinned, its
credit kept) this long after its last request."""
MAX_WAIT_NS = 2_000_000_000
"""With a store: the longest a request waits, in all, for credit not yet
arrived. A grant comes one lease interval and a round trip after the
user's first request (~20 ms), later on a loaded machine (a 2-core one
beside a busy loop took over 100 ms, the bound this was, and refused the
first request); a store that stops answering is left for the fallback
after two round trips that time out (outrate.budget.shared.runner: ~1 s),
whose local share is credit too."""


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
    pending_ns: int = 0
    """Refused only because this API server holds no credit for the user
    yet (a shared budget: its first request here): ask again after this
    long (at most `MAX_WAIT_NS`); 0 otherwise."""


UNLIMITED = Admission(True, UNLIMITED_REQUESTS, -1, 0, 0)


async def admit_waiting(
    table: RequestTable,
    policy: CompiledPolicy,
    user: str,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> Admission:
    """`table.admit`, asked again while the refusal is only for credit on
    its way (`pending_ns`), up to `MAX_WAIT_NS` from the first ask by the
    table's clock: the middleware's decision for one request."""
    first = table.clock()
    admission = table.admit(policy, user, first)
    while admission.pending_ns and table.clock() - first < MAX_WAIT_NS:
        await sleep(admission.pending_ns / NS_PER_S)
        admission = table.admit(policy, user)
    return admission


class RequestTable:
    """Each user's request bucket, in one API-server process."""

    def __init__(
        self,
        clock: Callable[[], int] = time.monotonic_ns,
        lender: Lender | None = None,
        policy: CompiledPolicy | None = None,
    ) -> None:
        self.clock = clock
        self._table: Limiter | None = None
        self._policy: CompiledPolicy | None = None
        self.lender = lender
        self._live: dict[str, list[int]] = {}
        """With a lender: users pinned, and when each last sent (ns)."""
        self._idle: deque[str] = deque()
        self._pinned: dict[str, Bucket] = {}
        if policy is not None:
            self.table_for(policy)

    def table_for(self, policy: CompiledPolicy) -> Limiter:
        """The table, made at the first policy (a lease thread needs it
        before the first request: `open_requests`)."""
        if self._table is None:
            self._table = Limiter(policy.requests, clock=self.clock, lender=self.lender)
            self._policy = policy
        return self._table

    def admit(self, policy: CompiledPolicy, user: str, now: int | None = None) -> Admission:
        """Take one request from `user`'s bucket under `policy` (the policy in
        force at this request's admission; a newer one swaps in here)."""
        if now is None:
            now = self.clock()
        table = self._table
        if table is None:
            table = self.table_for(policy)
        elif policy is not self._policy:
            table.set_policy(policy.requests, now)
            self._policy = policy
        if policy.requests.limit_for(user).rate is None and user not in table:
            return UNLIMITED  # no state for the unlimited
        b = table.bucket(user) if self.lender is None else self._pin(table, user, now)
        lim = table.limit_of(b, now)
        if lim.rate is None:
            return UNLIMITED
        admitted = table.take(b, now)
        if admitted:
            decision = Admission(True, lim, table.available(b, now), 0, 0)
        elif lim.shadow:  # counted, not enforced: the bucket does not move
            decision = Admission(True, lim, 0, 0, 0, over=True)
        else:
            wait = table.ready_at(b, now) - now
            decision = Admission(False, lim, 0, wait, 0, over=True)
            if self.lender is not None and wait <= MAX_WAIT_NS and table.waits_for_credit(b, now):
                decision = decision._replace(pending_ns=max(wait, 1))
        decision = decision._replace(reset_ns=table.full_at(b, now) - now)
        if self.lender is not None:
            self._unpin_idle(table, now)
        table.cleanup(now, CLEANUP_BUDGET)
        return decision

    def _pin(self, table: Limiter, user: str, now: int) -> Bucket:
        """The user's bucket, pinned while it sends (its demand registered
        with the store, its credit kept)."""
        seen = self._live.get(user)
        if seen is not None:
            seen[0] = now
            return self._pinned[user]
        b = table.pin(user)
        self._pinned[user] = b
        self._live[user] = [now]
        self._idle.append(user)
        return b

    def _unpin_idle(self, table: Limiter, now: int) -> None:
        """Unpin up to `CLEANUP_BUDGET` users examined that sent nothing for `IDLE_NS`."""
        idle, live = self._idle, self._live
        for _ in range(min(CLEANUP_BUDGET, len(idle))):
            user = idle.popleft()
            if now - live[user][0] >= IDLE_NS:
                del live[user]
                table.unpin(self._pinned.pop(user))
            else:
                idle.append(user)

    def __len__(self) -> int:
        return 0 if self._table is None else len(self._table)
