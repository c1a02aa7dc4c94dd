"""Lending: spare capacity to users over their committed rate, up to their peak.

The rule (docs/policy-reference.md, "peak"): a borrowed token comes only from
capacity that no committed request can use in that step. A request is
*committed* while its user is within its committed rate (`rate`); tokens
between `rate` and `peak` are *borrowed* and charged to the user's excess
bucket alone (`Limit.excess`), so borrowing leaves no debt on the committed
budget.

How a step keeps the rule (`plan`, at the step's start, after held committed
requests were released and before stock's `schedule()`):

- The committed demand is counted first: running requests that are not
  borrowing, each with its tokens (a decode one, a prefill the rest of its
  prompt: an upper bound, so prefix-cache hits only leave more), and the
  *committed newcomers*: waiting requests of users without a peak that
  admission lets in within their committed rate (`committed_queue`), each
  with a seat and its prompt's tokens. A waiting request whose user is over
  its rate waits on its own budget, not on a borrower: it is not demand.
- What is left of `--max-num-active-seqs` and of the step's token budget is
  lent to held requests and new prompts of users whose peak allows a token
  (`StepScratch.borrow_quota`), one at a time, to the user with the least
  borrowed service; borrowing requests beyond it are held again at once,
  before stock's loops run (`reclaimed`). While a committed newcomer waits,
  no borrower's new prompt is admitted (stock admits in queue order), and
  held requests of borrowing users give up the resident slots the
  newcomers lack (`displaced`).
- Borrowers run after every committed request in `running`: served last
  within the token budget, and under FCFS the first preempted for KV.

Fair sharing (VTC's service counters): each user's borrowed service is kept
in seconds of its committed rate (`served += 1 / rate` per borrowed token);
spare capacity goes to the smallest counter, so over time users borrow in
proportion to their committed rates. A user that starts borrowing is lifted
to the smallest counter of those borrowing, and no counter stays more than
`FAIR_WINDOW_S` above it: service is compared over a recent window, not
forever. Prompt borrowers (a prompt `peak`, prompts.py) share the step's
spare prompt time the same way, by their own counter (`pserved`, seconds of
the prompt rate): their running prefills reach it least served first
(`prompt_order`).

Plain Python over the scheduler's records (state.py): no vLLM import.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from outrate.budget.store import BudgetStore
from outrate.observe.metrics import Metrics
from vllm_integration.step.holdback import Holdback
from vllm_integration.step.state import ATTR, RequestState, StepScratch, UserState
from vllm_integration.step.steptime import HEADROOM, StepCost

if TYPE_CHECKING:
    from vllm.v1.request import Request

FAIR_WINDOW_S = 1.0
"""How far (seconds of committed rate) one borrower's service may run ahead of
the least served when capacity is shared: the fairness window."""


def committed_queue(u: UserState, limiter: BudgetStore, now: int) -> int:
    """How many of `u`'s requests that hold no slot (waiting, or preempted)
    are committed demand now: those admission (admission.py) lets in as
    committed, one committed token each. None for a user with a peak (its
    new prompts come in as it borrows, `Lending.admit`) or with held
    requests (they come back first); at most its `max_streams` room and,
    unless its rule is in shadow, its committed budget. A newcomer whose
    user is over its rate waits on its own budget, not on a borrower: it
    holds back no lending (it may prefill ahead only in a seat nobody
    takes, as beside a user within its rate)."""
    queued = u.live - u.resident
    if queued <= 0 or u.n_held:
        return 0
    lim = limiter.limit_of(u.bucket, now)
    if lim.excess is not None:
        return 0
    if lim.max_streams is not None and lim.max_streams - u.resident < queued:
        queued = lim.max_streams - u.resident
    if not lim.shadow:
        avail = u.left or limiter.available(u.bucket, now)
        if avail < queued:
            queued = avail
    return queued if queued > 0 else 0


def _prompt_tokens(
    waiting: Iterable[Request], queued: dict[UserState, int]
) -> dict[UserState, int]:
    """Per user in `queued`, the tokens its first `queued[u]` waiting
    requests still have to compute: committed newcomers' prompts, in the
    order stock admits them."""
    left = dict(queued)
    n = sum(left.values())
    tokens: dict[UserState, int] = {}
    for r in waiting:
        rs = r.__dict__.get(ATTR)
        if rs is None or not left.get(rs.user):
            continue
        u = rs.user
        left[u] -= 1
        tokens[u] = tokens.get(u, 0) + r.num_tokens - r.num_computed_tokens
        n -= 1
        if not n:
            break
    return tokens


def _held(r: Any) -> bool:
    rs = r.__dict__.get(ATTR)
    return rs is not None and rs.held


def _prompt_borrows(u: UserState, step: int) -> bool:
    """Whether `u` borrows prompt tokens now: under a prompt peak its prompt
    budget fell short of what it asked in the step before (prompts.py)."""
    return u.pshort_step >= step - 1


class Lending:
    def __init__(
        self, limiter: BudgetStore, metrics: Metrics, holdback: Holdback, st: StepScratch
    ) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.holdback = holdback
        self.st = st
        self.running: dict[Request, None] = {}  # borrowing requests in `running`, oldest first
        self.newcomers = 0  # committed newcomers waiting at this step's plan
        # What a step costs (steptime.py): borrowing spends only the step time
        # no committed user needs. None: slots and tokens alone bound it.
        self.cost: StepCost | None = None
        self.prompt_peaks = False  # some rule has a prompt peak: prompt borrowers are ordered
        self.prompts: BudgetStore | None = None  # the prompt budgets (prompts.py's table)

    def __len__(self) -> int:
        return len(self.running)

    # -- a step's plan -------------------------------------------------------

    def plan(
        self,
        now: int,
        step: int,
        running: list[Request],
        users: Iterable[UserState],
        waiting: Iterable[Request],
        active: int,
        resident: int,
        budget: int,
    ) -> list[Request]:
        """Size this step's lending (see the module docstring). `waiting`:
        stock's waiting queue; `active`: `--max-num-active-seqs`; `resident`:
        the resident slots free for new requests (`--max-num-seqs` less
        running and held); `budget`: the step's token budget; `step`: its number. Returns the
        running list the step should use: reclaimed borrowers out of it, and
        every borrower after every committed request, so stock's loop serves
        committed requests first (token budget) and, under FCFS, preempts a
        borrower first (KV)."""
        st = self.st
        borrowing = self.running
        committed = 0
        demand = 0
        # Under a timed prompt peak: the prompt each user's committed
        # requests have left (`_spare_us`: who is about to borrow it).
        prefill: dict[UserState, int] | None = (
            {} if self.prompt_peaks and self.cost is not None else None
        )
        for r in running:
            if r not in borrowing:
                committed += 1
                left = r.num_tokens - r.num_computed_tokens
                demand += left if left > 1 else 1
                if prefill is not None and left > 1:
                    rs = r.__dict__.get(ATTR)
                    if rs is not None and rs.prompt_done < r.num_prompt_tokens:
                        k = r.num_prompt_tokens - rs.prompt_done
                        prefill[rs.user] = prefill.get(rs.user, 0) + k
        users = list(users)
        queued = {u: n for u in users if (n := committed_queue(u, self.limiter, now))}
        self.newcomers = n_wait = sum(queued.values())
        tokens = budget - demand
        if n_wait:  # their seats and their prompts first
            newcomers = _prompt_tokens(waiting, queued)
            tokens -= sum(newcomers.values())
            if prefill is not None:
                for u, k in newcomers.items():
                    prefill[u] = prefill.get(u, 0) + k
        allowance = min(active - committed - n_wait, tokens)
        spare_us = -1.0  # the step time borrowers may fill (< 0: not bounded by time)
        if self.cost is not None:
            work = budget - tokens  # committed tokens this step (an upper bound)
            prompt = (work if work < budget else budget) - committed - n_wait  # beyond one each
            spare_us = self._spare_us(
                users, queued, committed + n_wait, prompt, step, now, prefill or {}
            )
            if spare_us >= 0:
                allowance = min(allowance, self.cost.seqs_within(spare_us))
        if allowance < 0:
            allowance = 0
        if len(borrowing) > allowance:
            self.metrics.reclaimed += len(borrowing) - allowance
        self._share(allowance, now, running, users)
        # A borrower's new prompt needs a resident slot, and waits behind
        # every committed newcomer (stock admits in queue order).
        spare = min(sum(st.borrow_quota.values()), resident) if not n_wait else 0
        st.borrow_slots = spare if spare > 0 else 0
        st.borrow_tokens = tokens - len(borrowing)
        st.borrow_timed = spare_us >= 0
        if st.borrow_timed and self.cost is not None:  # prompt tokens in the time left
            seqs = len(borrowing) + sum(st.borrow_quota.values())
            timed = self.cost.prompt_within(spare_us, seqs)
            if timed < st.borrow_tokens:
                st.borrow_tokens = timed
        if not borrowing:
            out = [r for r in running if not _held(r)] if committed < len(running) else running
        else:
            out = [r for r in running if r not in borrowing and not _held(r)] + list(borrowing)
        return self.prompt_order(out, users, step) if self.prompt_peaks else out

    def prompt_order(
        self, running: list[Request], users: list[UserState], step: int
    ) -> list[Request]:
        """`running` with the prefills of prompt borrowers (users whose prompt
        budget fell short in the step before, prompts.py) after every other
        committed request and before output borrowers, the user with the
        least borrowed prompt service (`UserState.pserved`) first: stock's
        running loop gives the step's spare prompt time
        (`StepScratch.borrow_tokens`, or stock's token budget) in that order,
        so over time prompt borrowers share it in proportion to their prompt
        rates, not by whose request came first or whose prompt is longest;
        under FCFS, KV preemption reaches them before any committed request.
        No counter stays more than `FAIR_WINDOW_S` above the least, so a user
        back after a pause is ahead by at most that. No lift (`_share`
        lifts a user that starts borrowing): a prompt borrower whose chunks
        the step served whole is still in the race, and lifting it would
        forgive it the deficit it is catching up. Unchanged without a
        prompt borrower."""
        members = {u: None for u in users if _prompt_borrows(u, step)}
        if not members:
            return running
        floor = min(u.pserved for u in members)
        for u in members:
            if u.pserved > floor + FAIR_WINDOW_S:
                u.pserved = floor + FAIR_WINDOW_S
        mine: list[Request] = []
        rest: list[Request] = []
        for r in running:
            rs = r.__dict__.get(ATTR)
            prefill = rs is not None and not rs.borrowing and rs.user in members
            if prefill and r.num_computed_tokens < r.num_prompt_tokens:
                mine.append(r)
            else:
                rest.append(r)
        if not mine:
            return running
        mine.sort(key=lambda r: r.__dict__[ATTR].user.pserved)  # stable: oldest first within
        tail = len(rest) - len(self.running)  # output borrowers: the list's end (`plan`)
        return rest[:tail] + mine + rest[tail:]

    def _spare_us(
        self,
        users: list[UserState],
        queued: dict[UserState, int],
        seqs: int,
        prompt: int,
        step: int,
        now: int,
        prefill: dict[UserState, int],
    ) -> float:
        """The step time borrowers may fill beside the committed work (`seqs`
        requests, `prompt` prompt tokens): `HEADROOM` x the longest step in
        which every committed user still gets its rate, `n_u / r_u` for `n_u`
        streams resident or admitted now, less the committed work's
        predicted length (0 when that alone is longer). -1: no committed
        user has a finite rate to keep, and borrowing is bounded by slots
        and tokens alone (work conserving). Users borrowing now are past
        their rate already (`_borrows`); rules in shadow promise nothing. A
        user about to borrow prompt tokens in this step (`_prompt_short`:
        `prefill`, the prompt its committed requests have left) counts as
        committed only beside another borrower: a lone borrower's own rate
        does not hold back its own borrowing, and two bound each other."""
        assert self.cost is not None
        targets: list[tuple[float, bool]] = []  # (n_u / r_u, about to borrow)
        borrowers = 0
        for u in users:
            lim = u.bucket.limit
            if lim.rate is None or lim.shadow:
                continue
            if self._borrows(u, step):
                borrowers += 1
                continue
            n = u.resident + queued.get(u, 0)
            if n:
                short = bool(prefill) and self._prompt_short(u, prefill.get(u, 0), now)
                borrowers += short
                targets.append((n * lim.token_s, short))
        longest = 0.0
        for target, short in targets:
            if short and borrowers == 1:
                continue
            if not longest or target < longest:
                longest = target
        if not longest:
            return -1.0
        spare = HEADROOM * longest * 1e6 - self.cost.predict_us(seqs, prompt if prompt > 0 else 0)
        return spare if spare > 0 else 0.0

    def _prompt_short(self, u: UserState, want: int, now: int) -> bool:
        """Whether `u` borrows prompt tokens in this step: under a prompt
        peak, its committed requests have more prompt left (`want`) than its
        prompt budget holds now, and prompts.py lends it the rest. Without
        this, a user whose budget fell short in no step before (its last
        request's prompt done, a new one just in) was counted committed, and
        its own output rate cut its own borrowed chunk (a prompt finished in
        two steps instead of one: test_scheduler_prompt_peak's own
        commitment)."""
        pb, table = u.pbucket, self.prompts
        if not want or pb is None or table is None:
            return False
        lim = table.limit_of(pb, now)
        return lim.excess is not None and not lim.shadow and want > table.available(pb, now)

    def _borrows(self, u: UserState, step: int) -> bool:
        """Whether `u` borrows now: output tokens (a request running on spare
        capacity), or prompt tokens under a prompt peak (its prompt budget
        fell short of what it asked in the step before: prompts.py)."""
        return bool(u.n_borrowing) or _prompt_borrows(u, step)

    def cut(self, n: int) -> int:
        """A running borrower's prefill chunk of `n` tokens, cut to the prompt
        tokens this step's time has left (`plan`); its first token is paid
        for with its slot."""
        st = self.st
        left = st.borrow_tokens
        m = n if n <= left + 1 else (left + 1 if left > 0 else 1)
        st.borrow_tokens = left - (m - 1)
        return m

    def _share(self, k: int, now: int, running: list[Request], users: Iterable[UserState]) -> None:
        """Give `k` slots to borrowers, one at a time to the user with the least
        borrowed service: release held requests for users short of their
        share, hold borrowers of users past it (the most served first)."""
        limiter = self.limiter
        pool: list[tuple[float, int, UserState, float]] = []
        cap: dict[UserState, int] = {}
        members = [
            u
            for u in users
            if (u.n_borrowing or u.n_held or u.live > u.resident)
            and u.bucket.limit.excess is not None
        ]
        for u in members:  # how many it could borrow with: running, held, new prompts
            wants = u.n_borrowing + u.n_held + u.live - u.resident
            cap[u] = wants if limiter.can_borrow(u.bucket, now) else 0
        active = [u.served for u in members if u.n_borrowing and cap[u]]
        floor = min(active) if active else min((u.served for u in members), default=0.0)
        for i, u in enumerate(members):
            # VTC's lift, bounded: service is compared over a recent window.
            if u.served < floor and not u.n_borrowing:
                u.served = floor
            elif u.served > floor + FAIR_WINDOW_S:
                u.served = floor + FAIR_WINDOW_S
            pool.append((u.served, i, u, u.bucket.limit.token_s))
        heapq.heapify(pool)
        share: dict[UserState, int] = dict.fromkeys(members, 0)
        while k > 0 and pool:
            key, i, u, inc = heapq.heappop(pool)
            if share[u] >= cap[u]:
                continue
            share[u] += 1
            k -= 1
            heapq.heappush(pool, (key + inc, i, u, inc))
        for r in sorted(self.running, key=lambda r: -r.__dict__[ATTR].user.served):
            u = r.__dict__[ATTR].user
            if u.n_borrowing > share.get(u, 0):
                self.stop(r)
                self.holdback.hold(r, now)
                if not u.armed:
                    self.holdback.arm(u, now)
        quota = self.st.borrow_quota
        quota.clear()
        for u, n in share.items():
            while u.n_borrowing < n and self.holdback.release_user(u, 1, now, running):
                r = running[-1]
                r.__dict__[ATTR].borrowing = True
                u.n_borrowing += 1
                self.running[r] = None
                self.metrics.lent += 1
            if u.n_borrowing < n:
                quota[u] = n - u.n_borrowing  # the rest of its share: new prompts (admit)

    # -- bookkeeping -----------------------------------------------------------

    def admit(self, rs: RequestState, request: Request, now: int) -> bool:
        """A borrower's new prompt, admitted now if spare capacity is left and
        no committed request waits (`plan` said so); its sampling token will
        be borrowed."""
        st = self.st
        u = rs.user
        share = st.borrow_quota.get(u, 0)
        if st.borrow_slots <= 0 or share <= 0 or not self.limiter.can_borrow(u.bucket, now):
            return False
        cost = request.num_tokens - request.num_computed_tokens
        if cost > st.borrow_tokens:
            return False
        st.borrow_slots -= 1
        st.borrow_quota[u] = share - 1
        st.borrow_tokens -= cost
        rs.borrowing = True
        u.n_borrowing += 1
        self.running[request] = None
        return True

    def stop(self, r: Request, rs: RequestState | None = None) -> None:
        """`r` stops borrowing (held, preempted, finished, not admitted); `rs`:
        its record, where the request no longer carries it (finished)."""
        if rs is None:
            rs = r.__dict__.get(ATTR)
        if rs is not None and rs.borrowing:
            rs.borrowing = False
            rs.user.n_borrowing -= 1
            self.running.pop(r, None)

    def charged(self, rs: RequestState, u: UserState) -> None:
        """A borrowed token was charged: count its service."""
        u.served += u.bucket.limit.token_s
        u.m.borrowed += 1

    def refunded(self, rs: RequestState, u: UserState) -> None:
        u.served -= u.bucket.limit.token_s
        u.m.borrowed -= 1

    def displaced(self, users: Iterable[UserState], free: int) -> list[Request]:
        """Resident slots for this step's committed newcomers (`plan` counted
        them): held requests of borrowing users (rules with a peak), as many
        as the newcomers lack beside the `free` resident slots (held requests
        narrow admission's cap, `--max-num-seqs` less the held), the youngest
        of the user holding the most slots first. Fair admission's
        one-a-step, two-more-slots rule is for users within their rates; a
        user over its committed rate gives way at once. The caller preempts
        them (their prefix cache keeps what it can)."""
        k = self.newcomers - free
        if k <= 0:
            return []
        pool = {u: u.resident for u in users if u.n_held and u.bucket.limit.excess is not None}
        victims: list[Request] = []
        chosen: set[Request] = set()
        while k > 0 and pool:
            u = max(pool, key=pool.__getitem__)
            live = [e for e in u.held if _held(e[2]) and e[2] not in chosen]
            if not live:
                del pool[u]
                continue
            r = max(live, key=lambda e: (e[0], e[1]))[2]
            victims.append(r)
            chosen.add(r)
            pool[u] -= 1
            k -= 1
        return victims
