"""The GCRA decision, `gcra()`, and the limits it runs on (`Limit`).

`gcra()` is the one place that decides whether tokens conform: every verb
of every budget store (the in-memory `Limiter`, the same table lent credit by
a shared budget) asks it, so a reader keeps one formula in mind, not six.

Time is kept in *scaled units*: for a rate p/q tokens/s (a reduced fraction)
one nanosecond is `p` units and one token costs `1e9 * q` units, so any rate the
policy can express (fractions included) is paced exactly, with no rounding
drift over long runs. Each `Limit` carries its own scale; a user's state is the
theoretical arrival time (TAT) in its limit's units.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal
from fractions import Fraction

from outrate.budget.quota import Quota
from outrate.units import format_duration, format_rate

NS_PER_S = 1_000_000_000


def gcra(tat: int, now: int, interval: int, tolerance: int, n: int = 1) -> tuple[int, int]:
    """How many of `n` tokens asked for at `now`, back to back, conform, and
    the TAT once they are taken: `(k, tat')`, `0 <= k <= n` (`tat' == tat`
    when k is 0). All arguments in one limit's scaled units.

    A token conforms when the TAT is no more than `tolerance` ahead of `now`;
    each one taken moves the TAT by `interval`. A TAT in the past counts as
    `now`: an idle user is a fresh user. So `k` is how many steps of
    `interval` fit between the TAT and `now + tolerance`, plus one.
    """
    ahead = tat - now
    if ahead > tolerance or n <= 0:
        return 0, tat
    if ahead < 0:
        ahead, tat = 0, now
    if n == 1:  # one token conforms: a decode step's usual ask needs no division
        return 1, tat + interval
    k = (tolerance - ahead) // interval + 1
    if n < k:
        k = n
    return k, tat + k * interval


def exact_rate(value: int | float | str | Decimal | Fraction) -> Fraction:
    """The exact rate a human wrote: 0.1 is 1/10, not the nearest binary float."""
    if isinstance(value, Fraction):
        return value
    if isinstance(value, float):
        return Fraction(Decimal(repr(value)))
    if isinstance(value, str):  # '0.1' and '1/3' alike; junk is a ValueError
        try:
            return Fraction(value)
        except ZeroDivisionError as e:
            raise ValueError(f"rate {value!r} divides by zero") from e
    return Fraction(Decimal(str(value)))


_INTS: dict[int, int] = {}


def _shared_int(v: int) -> int:
    """One int object per value across all Limits: a take reads three of them
    per call, and a policy of many rules with the same rate (one per listed
    user) then touches the same three objects instead of three per user."""
    if len(_INTS) > 100_000:
        _INTS.clear()
    return _INTS.setdefault(v, v)


PEAK_UNLIMITED = "unlimited"
"""`Limit(peak=PEAK_UNLIMITED)`: borrow without a cap of its own."""


class Limit:
    """One resolved limit: rate (None = unlimited), burst and stream cap,
    and a `peak` above the rate (work-conserving limits).

    `rate` is the committed rate. With a `peak`, tokens between `rate` and
    `peak` are *borrowed*: the scheduler grants them only from capacity no
    committed request can use, and charges them to a second bucket alone,
    `excess`, at `peak - rate` with the same burst (None: no borrowing;
    unlimited for `peak: unlimited`). Two independent buckets (the committed
    and excess buckets of MEF 10's bandwidth profile, CIR and EIR) so a
    borrowed token leaves no debt on the committed one; together they bound a
    user's tokens in any window by `(W + burst) * peak + 2`.

    Immutable and shared by every user that resolves to the same rule, so it
    costs nothing per user. `scale`, `interval` and `tolerance` are the GCRA
    integers in this limit's scaled units (see module docstring).
    """

    __slots__ = (  # the take's first: fewer cache lines per call
        "scale",
        "interval",
        "tolerance",
        "rate",
        "burst_ns",
        "max_streams",
        "rule",
        "shadow",
        "label",
        "peak",
        "excess",
        "token_s",
        "prompt",
        "requests",
        "quotas",
    )

    def __init__(
        self,
        rate: Fraction | int | float | str | None,
        burst_ns: int,
        max_streams: int | None = None,
        rule: str = "",
        shadow: bool = False,
        label: str = "",
        peak: Fraction | int | float | str | None = None,
        prompt: Limit | None = None,
        requests: Limit | None = None,
        quotas: tuple[Quota, ...] = (),
    ) -> None:
        if rate is not None:
            rate = exact_rate(rate)
            if rate <= 0:
                raise ValueError(f"rate must be > 0, got {rate}")
        if peak is not None and peak != PEAK_UNLIMITED:
            peak = exact_rate(peak)
            if rate is not None and peak < rate:
                raise ValueError(f"peak must be >= rate ({rate}), got {peak}")
        if peak is not None and rate is None:
            raise ValueError("peak needs a finite rate: an unlimited rule has nothing to borrow")
        if peak == rate:
            peak = None  # nothing between the two: no borrowing
        if burst_ns <= 0:
            raise ValueError(f"burst must be > 0 ns, got {burst_ns}")
        if max_streams is not None and max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self.rate: Fraction | None = rate
        self.burst_ns = int(burst_ns)
        self.max_streams = max_streams
        self.rule = rule
        self.shadow = shadow
        """Computed and counted, never enforced: nobody is held, no prefill capped."""
        self.label = label
        """The `limit` label of this rule's metrics (`default`, `tier:pro`, ...)."""
        self.token_s = 0.0 if rate is None else float(1 / rate)
        """Seconds of this rate one token is (a float: borrowers' service counters)."""
        self.peak: Fraction | str | None = peak
        """None: no borrowing (peak = rate); `PEAK_UNLIMITED`; or the peak rate."""
        self.excess: Limit | None = None
        """The bucket borrowed tokens are charged to (rate `peak - rate`)."""
        self.prompt: Limit | None = prompt
        """The rule's limit on prompt tokens computed (its own bucket, in a
        second table: docs/prompt-limits.md); None: prompts unlimited."""
        self.requests: Limit | None = requests
        """The rule's request rate (`per_window`), checked in the API server
        before tokenization; None: requests unlimited."""
        self.quotas = quotas
        """The rule's token quotas per calendar window (`quota:`): counted by
        the engine, refused (429) by the API server once spent."""
        if peak is not None and rate is not None:
            extra = None if peak == PEAK_UNLIMITED else Fraction(peak) - rate
            self.excess = Limit(extra, self.burst_ns, rule=rule, label=label)
        if rate is None:
            self.scale = 0
            self.interval = 0
            self.tolerance = 0
        else:
            self.scale = _shared_int(rate.numerator)
            self.interval = _shared_int(NS_PER_S * rate.denominator)
            self.tolerance = _shared_int(self.burst_ns * rate.numerator)

    @property
    def unlimited(self) -> bool:
        return self.rate is None

    def scaled(self, share: Fraction) -> Limit:
        """This limit at `share` of its rate (same burst, stream cap and labels)."""
        assert self.rate is not None
        scaled = Limit(
            self.rate * share, self.burst_ns, self.max_streams, self.rule, self.shadow, self.label
        )
        # Borrowing is decided per engine (spare capacity is local): each
        # engine keeps the whole excess rate, not a share of it.
        scaled.peak, scaled.excess = self.peak, self.excess
        scaled.prompt = self.prompt
        scaled.requests = self.requests
        scaled.quotas = self.quotas
        return scaled

    def _key(self) -> tuple[object, ...]:
        return (
            self.rate,
            self.burst_ns,
            self.max_streams,
            self.shadow,
            self.peak,
            self.prompt,
            self.requests,
            self.quotas,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Limit) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def describe(self) -> str:
        """Human form used in log lines: `20 tok/s burst 100ms` or `unlimited`."""
        if self.rate is None:
            text = "unlimited"
        else:
            text = f"{format_rate(self.rate)} tok/s burst {format_duration(self.burst_ns)}"
        if self.peak == PEAK_UNLIMITED:
            text += " peak unlimited"
        elif self.peak is not None:
            text += f" peak {format_rate(Fraction(self.peak))}"
        if self.max_streams is not None:
            text += f" max_streams {self.max_streams}"
        if self.prompt is not None:
            text += f" prompt {self.prompt.describe()}"
        if self.requests is not None:
            text += f" requests {per_window_text(self.requests)}"
        if self.shadow:
            text += " (shadow)"
        return text

    def __repr__(self) -> str:
        return f"Limit({self.describe()!r}, rule={self.rule!r})"


def per_window(
    count: int, window_s: int, rule: str = "", label: str = "", shadow: bool = False
) -> Limit:
    """`count` requests per `window_s` seconds as a GCRA limit: `count` at once
    (back to back), then one every `window_s / count` seconds.

    The burst is the smallest whole number of ns that lets exactly `count`
    conform at once: `gcra()` grants `floor(burst * rate) + 1`, so the burst
    is `(count - 1) / rate` seconds, rounded up to a ns (1 ns for a count of
    1). Rounding up adds less than `count / (window_s * 1e9)` of a request,
    never a whole one. In any window of W seconds at most `W * rate + count`
    requests conform (the GCRA bound, `(W + burst) * rate + 1`)."""
    rate = Fraction(count, window_s)
    burst_ns = max(1, -(-(count - 1) * window_s * NS_PER_S // count))
    return Limit(rate, burst_ns, rule=rule, label=label, shadow=shadow)


def burst_count(lim: Limit) -> int:
    """How many conform back to back on a fresh bucket of `lim` (the
    `count` of a `per_window` limit); 0 when unlimited."""
    if lim.rate is None:
        return 0
    return lim.tolerance // lim.interval + 1


def per_window_text(lim: Limit) -> str:
    """A `per_window` limit as written: `5/s`, `300/min`, `7/60s` otherwise."""
    if lim.rate is None:
        return "unlimited"
    count = burst_count(lim)
    window = Fraction(count) / lim.rate
    if window == 1:
        return f"{count}/s"
    if window == 60:
        return f"{count}/min"
    return f"{count}/{format_rate(window)}s"


def lends(limits: Iterable[Limit | None]) -> bool:
    """Whether any of these limits has a peak, not in shadow (the scheduler
    lends only then; lint's OR012 asks the same)."""
    return any(lim is not None and lim.excess is not None and not lim.shadow for lim in limits)
