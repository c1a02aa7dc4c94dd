"""What a step costs, learned online from the engine's own steps: the time
measure of spare capacity that borrowing spends (docs/time-aware-borrowing.md).

The model is `outrate simulate`'s (outrate/simulate/stepmodel.py), linear in
what a step dispatches:

    T = fixed + per_seq x N + per_prompt x P

`N` the requests scheduled, `P` the tokens beyond one per request (prompt
positions, in the main). Both come from the scheduler's output in O(1)
(`len(num_scheduled_tokens)`, `total_num_scheduled_tokens`); a step's length
is the time to the next `schedule()`: sync steps run back to back, and under
async scheduling that is the pipeline's period, what tokens per second
follow. The simulator's `decode` (requests scheduled one token) and prompt
tokens price a prefill chunk of `n` at `per_prefill x n` where this model
prices it `per_seq + per_prompt x (n - 1)`: the same within one token.

The fit is least squares with exponential forgetting (half-life
`HALF_LIFE_STEPS`), as sums of `x x^T` and `x y` decayed each step, and a
ridge pull of one step's weight towards the prior (calibrate's model, or
the defaults): a direction no recent step varied (all decodes: no prompt
tokens) keeps the prior's slope instead of drifting, and the forgetting
cannot wind the estimate up. A 3x3 solve a step: O(1). Steps after which
the engine idled (longer than `IDLE_FACTOR` x the prediction) and steps
that dispatched nothing are left out, as `calibrate` leaves them out.

Plain Python: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

HEADROOM = 0.8
"""Borrowers may fill a step up to this share of the longest step every
committed user's rate allows: room for the model to under-predict by 25%."""
HALF_LIFE_STEPS = 200
"""Steps after which a sample counts half: long enough to average a noisy
machine's jitter, short enough to follow a neighbour's load."""
IDLE_FACTOR = 10
"""A gap longer than this many predicted steps is the engine waiting, not a
step (outrate/simulate/tracefit.py's rule, against the prediction)."""
PRIOR_WEIGHT = 1.0
"""The prior counts as this many steps, in each coefficient's direction."""
FREE_US = 1e-3
"""A marginal cost below this (1 ns) is none: the work costs no time."""


class CostModel(Protocol):
    """A prior: `StepModel` (outrate/simulate/stepmodel.py) is one."""

    @property
    def fixed_us(self) -> float: ...
    @property
    def per_decode_us(self) -> float: ...
    @property
    def per_prefill_us(self) -> float: ...


@dataclass(frozen=True)
class Prior:
    """The engine's prior without a calibrated model: the simulator's
    defaults (`StepModel()`, rough figures for an 8B model on one GPU; a test
    keeps the two equal). The fit replaces them within tens of steps."""

    fixed_us: float = 7000.0
    per_decode_us: float = 40.0
    per_prefill_us: float = 60.0


class StepCost:
    __slots__ = ("prior", "coef", "keep", "sxx", "sxy", "start", "n", "p", "samples")

    def __init__(self, prior: CostModel = Prior(), half_life_steps: int = HALF_LIFE_STEPS) -> None:
        self.prior = (prior.fixed_us, prior.per_decode_us, prior.per_prefill_us)
        self.coef = self.prior  # (fixed, per_seq, per_prompt) in us, each >= 0
        self.keep = 0.5 ** (1 / half_life_steps)
        self.sxx = [0.0] * 6  # sum of x x^T (upper triangle: 00 01 02 11 12 22)
        self.sxy = [0.0] * 3
        self.start = 0  # when the step being timed was dispatched (0: none)
        self.n = 0
        self.p = 0
        self.samples = 0

    def predict_us(self, n: int, p: int) -> float:
        a, b, c = self.coef
        return a + b * n + c * p

    def per_seq_us(self) -> int:
        """The cost of one more request as the model stands, in whole
        microseconds: what `seqs_within` divides spare time by (the trace's
        `per_seq_us`; 0 reads as free, and lends every free seat)."""
        return round(self.coef[1])

    # -- learning --------------------------------------------------------------

    def dispatched(self, now: int, n: int, tokens: int) -> None:
        """A step was dispatched at `now`: `n` requests, `tokens` tokens."""
        if n:
            self.start, self.n, self.p = now, n, tokens - n
        else:
            self.start = 0

    def timed_us(self) -> int:
        """The predicted length of the step being timed, in whole
        microseconds (0: none), the model as it stands before it learns
        from that step: the trace's `predicted_us`, against which a step's
        real length tells the model's error (the rule's bound holds while
        it is within `HEADROOM`'s 25%)."""
        return round(self.predict_us(self.n, self.p)) if self.start else 0

    def tick(self, now: int) -> None:
        """The next step starts at `now`: the one timed ended."""
        start = self.start
        if not start:
            return
        self.start = 0
        y = (now - start) / 1000
        if y > 0 and y <= IDLE_FACTOR * max(self.predict_us(self.n, self.p), 1.0):
            self.learn(self.n, self.p, y)

    def learn(self, n: int, p: int, y_us: float) -> None:
        """One step of `n` requests and `p` prompt tokens took `y_us`."""
        k = self.keep
        s, v = self.sxx, self.sxy
        s[0] = s[0] * k + 1.0
        s[1] = s[1] * k + n
        s[2] = s[2] * k + p
        s[3] = s[3] * k + n * n
        s[4] = s[4] * k + n * p
        s[5] = s[5] * k + p * p
        v[0] = v[0] * k + y_us
        v[1] = v[1] * k + n * y_us
        v[2] = v[2] * k + p * y_us
        self.samples += 1
        self.coef = self._solve()

    def _solve(self) -> tuple[float, float, float]:
        """(S + wI) theta = Sxy + w prior, by Cramer's rule. A coefficient
        the solve drives below 0 takes the prior's value: work never makes a
        step shorter, so a negative one is noise in a direction the recent
        steps did not vary. Lending itself makes such a direction: while it
        fills every free seat, each step holds the same number of requests.
        A slope clipped to 0 there read as "borrowers cost nothing", and the
        rule lent without a time bound (the likely cause of a committed user
        at 0.77x of its rate on a real engine, every step lent)."""
        s, v, w = self.sxx, self.sxy, PRIOR_WEIGHT
        pa, pb, pc = self.prior
        m00, m01, m02, m11, m12, m22 = s[0] + w, s[1], s[2], s[3] + w, s[4], s[5] + w
        r0, r1, r2 = v[0] + w * pa, v[1] + w * pb, v[2] + w * pc
        c00 = m11 * m22 - m12 * m12
        c01 = m02 * m12 - m01 * m22
        c02 = m01 * m12 - m02 * m11
        det = m00 * c00 + m01 * c01 + m02 * c02
        if det <= 0:  # not reached with w > 0 (positive definite); kept safe
            return self.coef
        c11 = m00 * m22 - m02 * m02
        c12 = m01 * m02 - m00 * m12
        c22 = m00 * m11 - m01 * m01
        a = (c00 * r0 + c01 * r1 + c02 * r2) / det
        b = (c01 * r0 + c11 * r1 + c12 * r2) / det
        c = (c02 * r0 + c12 * r1 + c22 * r2) / det
        return (a if a >= 0 else pa, b if b >= 0 else pb, c if c >= 0 else pc)

    # -- what fits -------------------------------------------------------------

    def seqs_within(self, spare_us: float) -> int:
        """How many more requests, one token each, fit in `spare_us` (>= 0).
        A marginal cost under `FREE_US` fits any number."""
        b = self.coef[1]
        if b < FREE_US:
            return 1 << 30
        return int(spare_us // b)

    def prompt_within(self, spare_us: float, seqs: int) -> int:
        """How many prompt tokens fit in `spare_us` beside `seqs` requests."""
        left = spare_us - seqs * self.coef[1]
        c = self.coef[2]
        if c < FREE_US:
            return 1 << 30 if left >= 0 else 0
        return int(left // c) if left > 0 else 0
