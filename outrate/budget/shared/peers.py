"""What the heartbeats tell one engine about the others: `Peers`.

Each engine heartbeats its id, its policy's sha256 and the number of engines
it counts (its fallback's N) into the store every second (the heartbeat
script, outrate.budget.shared.scripts). An engine that leaves deletes its
entry; one whose entry expires without leaving is *missing* for `HOLD_S`
more: dead, or cut off from the store and spending its fallback (rate/N,
for at most `HOLD_S`: outrate.budget.shared.runner). Nobody can tell the two
apart, so the live engines leave every missing engine its 1/N of each rate
until it is back or its fallback has run out (`scale`): the total stays
within the rate through a partial partition. Runs on the lease thread.
"""

from __future__ import annotations

import logging
from fractions import Fraction

from outrate.budget.shared.metrics import StoreMetrics

HOLD_S = 30.0
"""How long an engine that lost its store keeps spending its fallback
(rate/N, at most its last share), and so how long the others leave it its
part after its heartbeat stopped. Then its limited users wait for the store.
Every engine sharing a store must use the same value."""


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
        self, engines: list[tuple[str, str]], missing: list[tuple[str, int]], mine: str
    ) -> None:
        """A heartbeat's answer: the live engines (id, policy sha256) and
        the missing ones (id, N). Changes are logged once."""
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
                    "their part, keeping %s of each rate, for up to %.0f s",
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
        other = frozenset(f"{e} ({sha[:12]})" for e, sha in engines if sha != mine)
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
