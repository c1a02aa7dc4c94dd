"""A budget shared by several engines: local credit, leased from Redis.

`SharedLimiter` is the second `BudgetStore` (outrate.budget.store). The scheduler
talks to it exactly as to `Limiter`, and its hot path stays in memory: a
token is taken when the user's local GCRA conforms (as on one engine) *and*
the engine holds leased credit for the user. `LeaseRunner`
(outrate.budget.shared.runner), a thread in the engine core, keeps that credit
topped up from the global GCRA in Redis (outrate.budget.shared.lease): once per lease
interval it sends one pipelined round trip with a call for every user whose
credit ran below its slice (up to a cap per round; past it, users take
turns and their slices last until their next turn), and returns credit
that users who left this engine no longer need.

Fields of a `SharedBucket` have one writer each, so the two threads never
lock: the lease thread writes `granted` and `sent`, the scheduler `spent`
and `released`; credit is `granted - spent - released`. Credit a bucket no
longer needs is moved to `released` by the scheduler (when its last request
leaves, or at the next step when a grant arrives after that) and sent back
by the lease thread.

The bound (README "Several engines"): in any window W a user's tokens summed
over all engines stay within `(W + burst) * rate + 1 + S`, where S is the
credit outstanding at the window's start plus what Redis grants ahead of
now. An engine holds at most its fair
slice `max(1, ceil(rate * H * d_e / D))` (H the lease horizon, d_e its
requests of the user, D everyone's), and a lease call grants what conforms
within max(burst, H), so S = rate * (H + max(0, H - burst)) + N for N
engines serving the user (docs/DESIGN-store.md, "The bound").

When the store cannot be reached the scheduler keeps going on local GCRA
alone, at `rate / N` per engine (N: live engines at the last heartbeat) or
at the full rate (`fallback="full"`). Mode switches happen at a step
boundary (`cleanup`, `pin`) in the scheduler's thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from fractions import Fraction

from outrate.budget.limiter import NS_PER_S, Bucket, Limit, Limiter, LimitSource

LEASE_INTERVAL_S = 0.02
"""One round trip per 20 ms: a fifth of the default 100 ms burst, so four
engines' slices (rate * 20 ms in all) stay well inside one burst, and ~50
round trips/s per engine cost Redis nothing. A user's first token waits at
most half an interval (new users wake the lease thread early, at most twice
per interval) plus one round trip."""
FALLBACKS = ("share", "full")
FULL = Fraction(1)


class SharedBucket(Bucket):
    __slots__ = (
        "granted",
        "spent",
        "released",
        "sent",
        "fair",
        "demand",
        "reg_at",
        "leased",
        "reg",
        "share",
        "used",
        "seen",
    )

    def __init__(self, key: str, limit: Limit, gen: int) -> None:
        super().__init__(key, limit, gen)
        self.granted = 0  # lease thread: tokens Redis granted to this engine
        self.spent = 0  # scheduler: tokens taken (net of give_back)
        self.released = 0  # scheduler: credit handed back
        self.sent = 0  # lease thread: released credit returned to Redis
        self.fair = 0  # lease thread: the last fair slice Redis computed
        self.demand = 0  # lease thread: the demand last reported
        self.reg_at = 0  # lease thread: when it last wrote its demand to Redis
        self.leased = False  # lease thread: in its active set (keep the bucket)
        self.reg = False  # lease thread: demand registered in Redis
        self.share = FULL  # lease thread: this engine's share of the user's demand
        self.used: Fraction | None = None  # scheduler: the share its limit was resolved with
        self.seen = 0  # lease thread: `spent` at its last round

    @property
    def credit(self) -> int:
        return self.granted - self.spent - self.released


class SharedLimiter(Limiter):
    """A `Limiter` whose takes also spend credit leased from a shared store."""

    _bucket_cls = SharedBucket

    def __init__(
        self,
        policy: LimitSource,
        clock: Callable[[], int] = time.monotonic_ns,
        fallback: str = "share",
        engines_hint: int = 1,
        interval_s: float = LEASE_INTERVAL_S,
    ) -> None:
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        super().__init__(policy, clock)
        self.fallback = fallback
        self.shared = False
        """Applied mode (scheduler thread): True spends leased credit."""
        self.want_shared = False
        """Requested mode (lease thread); applied at the next step boundary."""
        self.grace = False
        """Applied: just back from the fallback, still within rate/N per engine."""
        self.want_grace = False
        """Requested by the lease thread; applied with the mode."""
        self.engines = max(1, engines_hint)
        """Live engines by the last heartbeat (lease thread)."""
        self.fallback_n = self.engines
        """N of the fallback in force: `engines` when the store went away."""
        self._scaled: dict[tuple[Limit, Fraction], Limit] = {}
        self.arrivals: deque[SharedBucket] = deque()
        """Buckets whose first request arrived (scheduler -> lease thread)."""
        self.settle: deque[SharedBucket] = deque()
        """Buckets granted credit after their last request left (lease -> scheduler)."""
        self.kick = threading.Event()
        self.interval_ns = int(interval_s * NS_PER_S)
        self.next_credit_ns = 0
        """When the next lease round is expected to have answered (lease thread)."""

    # -- modes -----------------------------------------------------------------

    def _local(self, b: Bucket, lim: Limit) -> Limit:
        """The local limit: the policy's rate times this engine's share of
        the user's demand (shared), or times 1/N (fallback `share`). Pacing
        each engine at its share is what makes engines share fairly: without
        it, the engine whose lease calls happen to land first after each
        token conforms in Redis would take them all."""
        sb: SharedBucket = b  # type: ignore[assignment]
        share = sb.used = sb.share
        if lim.rate is None:
            return lim
        split = self.fallback == "share" and self.fallback_n > 1
        if not self.shared:
            if not split:
                return lim
            share = Fraction(1, self.fallback_n)
        elif self.grace and split:
            # Just back from the fallback: other engines may still be in
            # theirs (they retry once a second), spending rate/N each without
            # Redis knowing. Until they are back, stay within rate/N too.
            share = min(share, Fraction(1, self.fallback_n))
        return self._scale(lim, share)

    def _scale(self, lim: Limit, share: Fraction) -> Limit:
        if share >= 1 or lim.rate is None:
            return lim
        key = (lim, share)
        scaled = self._scaled.get(key)
        if scaled is None:
            if len(self._scaled) > 10_000:
                self._scaled.clear()
            scaled = Limit(
                lim.rate * share,
                lim.burst_ns,
                lim.max_streams,
                lim.rule,
                lim.shadow,
                lim.label,
            )
            self._scaled[key] = scaled
        return scaled

    def _apply_mode(self) -> None:
        """Scheduler thread, between steps. Leaving shared mode drops the
        credit held (it was leased before the outage; dropping it never
        grants anything); either way every bucket re-resolves its limit and
        keeps its debt in tokens (Limiter._refresh)."""
        want = self.want_shared
        if want == self.shared:
            if self.want_grace != self.grace:
                self.grace = self.want_grace
                self._gen += 1
            return
        self.grace = self.want_grace
        if not want:
            for b in list(self._buckets.values()):
                sb: SharedBucket = b  # type: ignore[assignment]
                sb.spent = sb.granted - sb.released
            self.fallback_n = self.engines
        self._scaled.clear()
        self.shared = want
        self._gen += 1

    def set_policy(self, policy: LimitSource, now: int | None = None) -> None:
        self._scaled.clear()
        super().set_policy(policy, now)

    # -- the scheduler's verbs -------------------------------------------------

    def pin(self, user: str) -> Bucket:
        if self.want_shared is not self.shared or self.want_grace is not self.grace:
            self._apply_mode()
        b = super().pin(user)
        if b.pins == 1:
            self.arrivals.append(b)  # type: ignore[arg-type]
            self.kick.set()
        return b

    def unpin(self, b: Bucket) -> None:
        super().unpin(b)
        if b.pins == 0 and self.shared:
            sb: SharedBucket = b  # type: ignore[assignment]
            c = sb.granted - sb.spent - sb.released
            if c > 0:
                sb.released += c

    def take(self, b: Bucket, now: int) -> bool:
        if b.gen != self._gen or b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        lim = b.limit
        s = lim.scale
        if not s:
            return True
        shared = self.shared
        if shared and b.granted - b.spent - b.released <= 0:  # type: ignore[attr-defined]
            return False
        now_s = now * s
        tat = b.tat
        if tat < now_s:
            tat = now_s
        elif tat - now_s > lim.tolerance:
            return False
        b.tat = tat + lim.interval
        if shared:
            b.spent += 1  # type: ignore[attr-defined]
        return True

    def take_upto(self, b: Bucket, now: int, n: int) -> int:
        if b.gen != self._gen or b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        shared = self.shared and b.limit.scale
        if shared:
            c = b.granted - b.spent - b.released  # type: ignore[attr-defined]
            if c <= 0:
                return 0
            if n > c:
                n = c
        k = super().take_upto(b, now, n)
        if shared:
            b.spent += k  # type: ignore[attr-defined]
        return k

    def give_back(self, b: Bucket, now: int, n: int = 1) -> None:
        super().give_back(b, now, n)
        if self.shared and b.limit.scale:
            b.spent -= n  # type: ignore[attr-defined]

    def limit_of(self, b: Bucket, now: int) -> Limit:
        if b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        return super().limit_of(b, now)

    def ready_at(self, b: Bucket, now: int) -> int:
        if b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        t = super().ready_at(b, now)
        if self.shared and b.limit.scale and b.credit <= 0:  # type: ignore[attr-defined]
            nxt = self.next_credit_ns
            if nxt <= now:
                nxt = now + self.interval_ns // 4
            return max(t, nxt)
        return t

    def available(self, b: Bucket, now: int) -> int:
        if b.share is not b.used:  # type: ignore[attr-defined]
            self._refresh(b, now)
        n = super().available(b, now)
        if self.shared and b.limit.scale:
            c: int = b.credit  # type: ignore[attr-defined]
            return min(n, c) if c > 0 else 0
        return n

    def cleanup(self, now: int | None = None, budget: int = 64) -> int:
        if self.want_shared is not self.shared or self.want_grace is not self.grace:
            self._apply_mode()
        settle = self.settle
        while settle:
            b = settle.popleft()
            if b.pins == 0 and self.shared:
                c = b.granted - b.spent - b.released
                if c > 0:
                    b.released += c
        return super().cleanup(now, budget)

    def _forgettable(self, b: Bucket, now: int) -> bool:
        return super()._forgettable(b, now) and not b.leased  # type: ignore[attr-defined]
