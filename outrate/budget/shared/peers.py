"""What the heartbeats tell one engine about the others: `Peers`.

Each engine heartbeats its id, its policy's sha256, how long the others
must keep its part once its heartbeat stops (its hold, plus a retry and a
connect) and the number of engines it counts (its fallback's N) into the
store every second (the heartbeat script, outrate.budget.shared.scripts).
An engine that leaves deletes its entry; one whose entry expires without
leaving is *missing* for its own hold more: dead, or cut off from the store
and spending its fallback (rate/N: outrate.budget.shared.runner). Nobody can
tell the two apart, so the live engines leave every missing engine its 1/N
of each rate until it is back or its hold is over (`scale`): the total stays
within the rate through a partial partition as long as the hold. Past it,
an engine cut off in the fallback `local` keeps spending rate/N while the
others take its part back: at most (1 + M/N) x the rate in total with M of
N engines cut off (`pause` stops it at the hold instead). Engines that
heartbeat another hold or policy are reported (each keeps a missing engine's
part for that engine's own hold, so the bound holds anyway). Runs on the
lease thread.
"""

from __future__ import annotations

import logging
from fractions import Fraction

from outrate.budget.shared.metrics import StoreMetrics

HOLD_S = 30.0
"""How long the others leave an engine that lost its store its part after its
heartbeat stopped (`--outrate-store-hold-s`); with the fallback `pause`, also
how long that engine keeps spending rate/N before its limited users wait.
Every engine sharing a store should use the same value: each heartbeats its
own, and a mismatch is reported."""


class Peers:
    """The engines sharing the store, as this engine last heard them."""

    def __init__(
        self, metrics: StoreMetrics, log: logging.Logger, hint: int = 1, hold_s: float = HOLD_S
    ) -> None:
        self.metrics = metrics
        self.log = log
        self.hold_s = hold_s
        """How long the others keep a missing engine's part (the runner's `hold_s`)."""
        self.live = max(1, hint)
        """Live engines by the last heartbeat, this one included (the hint until one answered)."""
        self.missing: dict[str, int] = {}
        """Engines gone without leaving, each with the N its fallback divides by."""
        self._mismatch: frozenset[str] = frozenset()
        self._hold_mismatch: frozenset[str] = frozenset()

    @property
    def n(self) -> int:
        """What this engine's fallback divides each rate by: every engine
        that may be spending it, the missing ones too."""
        return self.live + len(self.missing)

    def scale(self) -> Fraction:
        """What the live engines keep of each rate: all of it, less 1/N per
        missing engine (its N), but never less than an equal part of all."""
        if not self.missing:
            return Fraction(1)
        left = Fraction(1) - sum(Fraction(1, max(1, n)) for n in self.missing.values())
        return max(left, Fraction(1, self.n))

    def heard(
        self,
        engines: list[tuple[str, str, int]],
        missing: list[tuple[str, int]],
        mine: str,
        keep_us: int = 0,
    ) -> None:
        """A heartbeat's answer: the live engines (id, policy sha256, how long
        the others keep its part, in us; 0: an engine that does not say) and
        the missing ones (id, N). `keep_us` is this engine's. Changes are
        logged once."""
        self.live = max(1, len(engines))
        self.metrics.engines = self.live
        gone = dict(missing)
        if gone.keys() != self.missing.keys():
            new = sorted(gone.keys() - self.missing.keys())
            back = sorted(self.missing.keys() - gone.keys())
            self.missing = gone
            if new:
                self.log.warning(
                    "outrate: %d engine(s) stopped heartbeating without leaving (%s): dead, "
                    "or cut off from the store and in their fallback; this engine leaves them "
                    "their part, keeping %s of each rate, for up to %g s",
                    len(new),
                    ", ".join(new),
                    self.scale(),
                    self.hold_s,
                )
            if back and not gone:
                self.log.info(
                    "outrate: no engine is missing any more (%s back or timed out): full "
                    "shares again",
                    ", ".join(back),
                )
        self.missing = gone
        self.metrics.engines_missing = len(gone)
        self._holds(engines, keep_us)
        other = frozenset(f"{e} ({sha[:12]})" for e, sha, _ in engines if sha != mine)
        self.metrics.policy_mismatch = len(other)
        if other != self._mismatch:
            if other:
                self.log.warning(
                    "outrate: %d engine(s) sharing the budget store run another policy than "
                    "this one (%s): %s; each enforces its own limits on the shared budgets",
                    len(other),
                    mine[:12],
                    ", ".join(sorted(other)),
                )
            elif self._mismatch:
                self.log.info("outrate: every engine sharing the store runs policy %s", mine[:12])
            self._mismatch = other

    def _holds(self, engines: list[tuple[str, str, int]], keep_us: int) -> None:
        """Report live engines whose hold differs from this one's: the others
        keep a missing engine's part for its own hold, so the bound holds, but
        a shorter hold on one engine changes what its users get in an outage."""
        other = frozenset(
            f"{e} ({(k - self._margin_us(keep_us)) / 1e6:g} s)"
            for e, _, k in engines
            if k and keep_us and k != keep_us
        )
        self.metrics.hold_mismatch = len(other)
        if other != self._hold_mismatch:
            if other:
                self.log.warning(
                    "outrate: %d engine(s) sharing the budget store run another "
                    "--outrate-store-hold-s than this one (%g s): %s; each engine's part is "
                    "kept for its own hold when it goes missing, but the engines should agree",
                    len(other),
                    self.hold_s,
                    ", ".join(sorted(other)),
                )
            elif self._hold_mismatch:
                self.log.info("outrate: every engine sharing the store holds %g s", self.hold_s)
            self._hold_mismatch = other

    def _margin_us(self, keep_us: int) -> int:
        """What `keep_us` adds to the hold (a retry and a connect)."""
        return keep_us - int(self.hold_s * 1_000_000)
