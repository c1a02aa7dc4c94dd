"""The store's health as one engine's lease thread sees it, and what each
switch publishes to the scheduler (a `Mode`, outrate.budget.shared.credit),
logs (once) and counts (`StoreMetrics`): `Faults`.

- Unreachable at start: with the fallback `local` (the default), rate/N
  locally, N the engines expected (`expected_from` says where N came from:
  `--outrate-store-engines`, the data-parallel size, or neither: 1); with
  `pause`, limited users wait for the store (an engine that never joined
  does not know its share); with `full`, the full rate. A store that answers
  but refuses the engine (`refused`: a wrong password, a cluster behind a
  plain URL) stops the start, unless the fallback is `full`: that is a
  configuration error, not an outage.
- Lost (`DOWN_AFTER` failed round trips in a row): rate/N locally, at most
  each user's last share, for as long as the outage lasts (`local`), or for
  `hold_ns` after the last answer and then limited users wait for the store
  (`pause`); the others leave this engine its part for the hold
  (outrate.budget.shared.peers).
- Back: shared again, within rate/N until every engine is (`Mode.grace`),
  while engines gone without leaving keep their part (`Mode.scale`).

Runs on the lease thread only.
"""

from __future__ import annotations

import logging
import time

from outrate.budget.limiter import NS_PER_S
from outrate.budget.shared.credit import Mode, SharedBudget
from outrate.budget.shared.metrics import StoreMetrics
from outrate.budget.shared.nodes import refused
from outrate.budget.shared.peers import Peers
from outrate.budget.shared.turns import Turns
from outrate.errors import OutrateError

DOWN_AFTER = 2
"""Consecutive failed round trips before an engine falls back: one slow
answer on a loaded machine (a starved process, not a slow store) is
retried at the next round instead of switching modes."""


FIX = "fix the URL, the password or the user's rights on the store (ACL)"
"""What mends a store that refuses the engine (a configuration error)."""
BORROWERS = (
    "users with a peak still borrow up to peak - rate on this engine (borrowing is "
    "local to each engine, never shared through the store)"
)
"""What `pause` leaves running: the store holds committed budgets only."""


class StoreRefused(OutrateError):
    """The store answered at start but will not serve this engine as
    configured (outrate.budget.shared.nodes.refused): the engine does not start."""


class Faults:
    """Up, lost, waiting or back, and the switches between them."""

    def __init__(
        self,
        budget: SharedBudget,
        metrics: StoreMetrics,
        peers: Peers,
        turns: Turns,
        log: logging.Logger,
        url: str,
        hold_ns: int,
        grace_ns: int,
        expected_from: str = "",
    ) -> None:
        self.budget = budget
        self.metrics = metrics
        self.peers = peers
        self.turns = turns
        self.log = log
        self.url = url
        self.hold_ns = hold_ns
        self.grace_ns = grace_ns
        self.expected_from = expected_from
        """Where the N of an engine that never reached its store came from (logged)."""
        self.up: bool | None = None  # None: not tried yet
        self.fails = 0  # consecutive failed round trips
        self.last_ok = 0
        """When a round trip last answered in full (monotonic ns; 0: never)."""
        self.grace_end = 0
        self.ever_up = False
        self.kinds: list[tuple[SharedBudget, Turns]] = [(budget, turns)]
        """Every kind of budget this engine shares (output, and prompt where
        the policy limits prompts): one mode for all, published to each."""

    def follow(self, budget: SharedBudget, turns: Turns) -> None:
        """Share another kind of budget (prompt tokens) through the same store:
        it falls back, waits and comes back with the first, in the same mode."""
        budget.mode = self.budget.mode
        self.kinds.append((budget, turns))

    def _publish(self, mode: Mode) -> None:
        """One mode record, assigned to every kind's budget."""
        for budget, _ in self.kinds:
            budget.mode = mode

    def answered(self) -> None:
        self.fails = 0
        self.last_ok = time.monotonic_ns()

    def failed(self, e: Exception) -> None:
        """A round trip (or an attempt to reach the store) failed."""
        self.metrics.errors += 1
        if self.up is False:
            return
        self.fails += 1
        if self.up and self.fails < DOWN_AFTER:
            return  # retried at the next round; credit held meanwhile still spends
        first = self.up is None
        self.up = False
        self.metrics.up = 0
        if first and self.budget.fallback == "pause":
            self._wait()
        else:
            self._publish(Mode(shared=False, grace=False, n=self.peers.n))
            self.metrics.fallback_since = time.monotonic_ns()
        for _, turns in self.kinds:
            for c in turns.active:
                c.reg = False  # Redis forgets demand by itself (TTL)
        if not first:
            self.metrics.transitions["down"] += 1
        if first and refused(e):
            if self.budget.fallback != "full":
                return  # `refuse` says it, and stops the start
            self.log.warning(
                "outrate: budget store %s refused this engine at start (%s: %s): %s, as "
                "--outrate-store-fallback full asks, and retrying; %s",
                self.url,
                type(e).__name__,
                e,
                self._describe(first),
                FIX,
            )
            return
        self.log.warning(
            "outrate: budget store %s %s (%s: %s): %s",
            self.url,
            "unreachable at start" if first else "lost",
            type(e).__name__,
            e,
            self._describe(first),
        )

    def _describe(self, first: bool) -> str:
        fallback = self.budget.fallback
        if fallback == "full":
            return "enforcing the full rate on each engine until it answers"
        hold = f"{self.hold_ns / NS_PER_S:g} s"
        if first and fallback == "pause":
            return (
                "limited users wait for it (--outrate-store-fallback pause: an engine that "
                "never joined does not know its share; the default, local, serves them at "
                f"rate/N meanwhile); {BORROWERS}"
            )
        n = self.peers.n
        if first:
            return (
                f"enforcing rate/{n} on this engine until it answers ({self.expected_from}); "
                "engines that did join do not know of this one, so while it is away a user "
                f"may get up to (1 + 1/{n}) x its rate in total"
            )
        if fallback == "pause":
            return (
                f"enforcing rate/{n} on each engine, at most each user's last share (engines: "
                f"{n}), for up to {hold}; then limited users wait for it ({BORROWERS})"
            )
        return (
            f"enforcing rate/{n} on each engine, at most each user's last share (engines: "
            f"{n}), until it answers; engines that still reach it leave this one its part "
            f"for {hold}"
        )

    def _wait(self) -> None:
        """Shared with no credit coming: limited users wait, they are not cut
        (fallback `pause` only)."""
        self._publish(Mode(shared=True, n=self.peers.n))
        self.metrics.waiting = 1
        self.metrics.fallback_since = 0

    def hold_left_s(self) -> float | None:
        """Seconds until the fallback runs out (None: it does not)."""
        if self.budget.fallback != "pause" or self.metrics.waiting or not self.last_ok:
            return None
        return max(0.0, (self.last_ok + self.hold_ns - time.monotonic_ns()) / NS_PER_S)

    def hold_ran_out(self) -> bool:
        """The fallback has lasted `hold_ns` since the last answer: the others
        stop keeping this engine's part, so its limited users wait now."""
        if self.hold_left_s() != 0.0:
            return False
        self._wait()
        self.log.warning(
            "outrate: budget store %s still lost after %g s: limited users wait for it "
            "now (the other engines stop keeping this engine's part); %s",
            self.url,
            self.hold_ns / NS_PER_S,
            BORROWERS,
        )
        return True

    def refuse(self, e: Exception, first: bool) -> None:
        """Raise `StoreRefused` for a store that refuses this engine at its
        first try (unless the fallback is `full`)."""
        if not first or not refused(e) or self.budget.fallback == "full":
            return
        msg = (
            f"outrate: budget store {self.url} refused this engine at start "
            f"({type(e).__name__}: {e}): not starting, since this is a configuration "
            "error, not an outage: waiting would not mend it, and an engine that never "
            f"joined would enforce its limits apart from the others for as long as it runs. "
            f"{FIX[0].upper()}{FIX[1:]}, or pass --outrate-store-fallback full to start at "
            "the full rate"
        )
        self.log.error(msg)
        raise StoreRefused(msg) from e

    def back(self, was_down: bool, debts: int, where: str) -> None:
        """The first round after (re)connecting answered: share again."""
        self.up = True
        self.metrics.up = 1
        self.metrics.waiting = 0
        self.metrics.fallback_since = 0
        if was_down:
            self.grace_end = time.monotonic_ns() + self.grace_ns
            self.metrics.transitions["up"] += 1
        # Back from the fallback, N is at least what it was: a restarted
        # Redis forgot the heartbeats of engines that may still be in theirs.
        n = max(self.budget.mode.n, self.peers.n) if was_down else self.peers.n
        self._publish(Mode(shared=True, grace=was_down, n=n, scale=self.peers.scale()))
        if not self.ever_up:
            self.ever_up = True
            self.log.info(
                "outrate: sharing budgets through %s (%s)%s",
                self.url,
                where,
                " after all" if was_down else "",
            )
        else:
            self.log.warning(
                "outrate: budget store %s is back: budgets shared again (%d user debt(s) "
                "carried over, no burst granted)",
                self.url,
                debts,
            )

    def heard(self) -> None:
        """After a heartbeat: end the grace once every engine is back (or
        had its chance), and follow the engines missing."""
        mode = self.budget.mode
        if not mode.shared or not self.up:
            return
        grace = mode.grace and not (
            self.peers.live >= mode.n or time.monotonic_ns() > self.grace_end
        )
        scale = self.peers.scale()
        if grace != mode.grace or scale != mode.scale:
            self._publish(mode._replace(grace=grace, scale=scale))
