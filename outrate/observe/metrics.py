"""Engine-side metrics: counted where decisions are made (publish.py takes
them to vLLM's /metrics).

The scheduler runs in vLLM's engine-core process; `/metrics` is served by the
API server. Rather than putting prometheus_client in the scheduler's hot path
(and switching the whole server into Prometheus multiprocess mode), the
scheduler counts in plain integers on one `LabelMetrics` record per `limit`
label, a `Publisher` thread writes a JSON snapshot of them twice a second
(atomic rename), and a collector registered in the API server turns the newest
snapshot into Prometheus families on each scrape (`families`).

Cardinality is bounded by construction: a label is a rule (`default`,
`anonymous`, `tier:NAME`, `match:PATTERN`), a user listed in the policy, or a
user opted in with `metrics.per_user`, at most `metrics.max_series` of those;
past the cap, opted-in users are counted under `other`.

Nothing here imports vLLM.
"""

from __future__ import annotations

from outrate.budget.limiter import NS_PER_S, Limit
from outrate.histogram import Histogram
from outrate.identity.core import ANONYMOUS
from outrate.policy.compiler import CompiledPolicy, is_rule_label

OTHER = "other"
"""Label of per-user series past `metrics.max_series`."""

BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Upper bounds of both histograms (seconds), from 1 ms to 60 s, then +Inf."""
BUCKETS_NS = tuple(round(b * NS_PER_S) for b in BUCKETS_S)

SNAPSHOT_FILE = "engine-metrics.json"
"""One engine's snapshot; with data parallel, rank r writes `engine-metrics.dp<r>.json`."""
PUBLISH_INTERVAL_S = 0.5

DEFERRED_REASONS = ("max_streams", "budget", "prompt")


class LabelMetrics:
    """Everything counted for one `limit` label. Mutated by the scheduler thread
    only; the publisher reads it (int reads are atomic under the GIL)."""

    __slots__ = (
        "label",
        "tokens",
        "shadow_over",
        "live",
        "held",
        "held_since_sum",
        "throttled_ns",
        "wait",
        "interval",
        "borrowed",
        "prompt",
        "prompt_over",
        "prompt_borrowed",
        "prompt_waiting",
        "prompt_waits",
    )

    def __init__(self, label: str) -> None:
        self.label = label
        self.tokens = 0  # charged, net of refunds (borrowed ones included)
        self.borrowed = 0  # of those, borrowed: between rate and peak, from spare capacity
        self.shadow_over = 0  # tokens a shadow limit would have refused
        self.prompt = 0  # prompt tokens charged (computed), net of refunds
        self.prompt_over = 0  # of those, beyond a shadow prompt limit
        self.prompt_borrowed = 0  # of those, borrowed: beyond the prompt rate, in spare time
        self.prompt_waiting = 0  # requests waiting for prompt budget now
        self.prompt_waits = 0  # waits for prompt budget started (deferred or skipped)
        self.live = 0  # requests in the engine (running, held or waiting)
        self.held = 0  # requests held for budget now
        self.held_since_sum = 0  # sum of their hold start times (ns)
        self.throttled_ns = 0  # request-ns of holds that ended
        self.wait = Histogram(BUCKETS_NS)  # duration of each hold
        self.interval = Histogram(BUCKETS_NS)  # time between consecutive charged tokens

    def hold(self, since: int) -> None:
        self.held += 1
        self.held_since_sum += since

    def unhold(self, since: int, now: int) -> None:
        self.held -= 1
        self.held_since_sum -= since
        waited = now - since if now > since else 0
        self.throttled_ns += waited
        self.wait.observe(waited)

    def throttled_total_ns(self, now: int) -> int:
        """Completed holds plus the ones still running, in O(1)."""
        return self.throttled_ns + self.held * now - self.held_since_sum


class Metrics:
    """The scheduler's counters: per-label records plus engine-wide counts.

    `label_of` decides which record a user is counted under; it runs once per
    user (when the user appears, and again after a policy swap), never per
    token.
    """

    def __init__(self) -> None:
        self.labels: dict[str, LabelMetrics] = {}
        self._series: set[str] = set()  # opted-in (metrics.per_user) users with a series
        self.displaced = 0
        self.deferred = dict.fromkeys(DEFERRED_REASONS, 0)
        # Engine-wide counts of the scheduler's actions (tests and benchmarks
        # read them; the per-label records carry what /metrics shows).
        self.holds = 0  # requests held for budget
        self.releases = 0  # held requests released
        self.refunded = 0  # tokens charged and not scheduled, given back
        self.reclaimed = 0  # borrowing requests held because a committed one needed the room
        self.lent = 0  # held requests released to borrow spare capacity
        self.prompt_refunded = 0  # prompt tokens charged and not scheduled, given back
        self.prompt_skips = 0  # running prefills skipped a step for prompt budget

    def record(self, label: str) -> LabelMetrics:
        m = self.labels.get(label)
        if m is None:
            m = self.labels[label] = LabelMetrics(label)
        return m

    def label_of(self, user: str, policy: CompiledPolicy) -> str:
        if user == ANONYMOUS:
            return "anonymous"
        if user in policy.users:
            return user  # listed: bounded by the policy itself
        if policy.wants_series(user) and not is_rule_label(user):  # else: its rule's
            series = self._series
            if user in series:
                return user
            if len(series) < policy.max_series:
                series.add(user)
                return user
            return OTHER
        return policy.limit_for(user).label or "default"

    def label_known(self, user: str, policy: CompiledPolicy) -> str:
        """`label_of` that never gives anyone a series, for threads other than
        the scheduler's (quota usage, outrate.observe.quotas): an opted-in user
        without a series yet is counted under `other`."""
        if user == ANONYMOUS:
            return "anonymous"
        if user in policy.users:
            return user
        if policy.wants_series(user) and not is_rule_label(user):
            return user if user in self._series else OTHER
        return policy.limit_for(user).label or "default"

    @property
    def n_series(self) -> int:
        return len(self._series)


def limit_of_label(label: str, policy: CompiledPolicy) -> Limit | None:
    """The limit a label stands for under `policy` (None for `other` or a
    label the policy no longer has)."""
    if label == "default":
        return policy.default
    if label == "anonymous":
        return policy.anonymous
    if label.startswith("tier:") and label[5:] in policy.tiers:
        return policy.tiers[label[5:]]
    if label.startswith("match:"):
        for pattern, lim in policy.patterns:
            if pattern == label[6:]:
                return lim
    if label == OTHER:
        return None
    if label in policy.users or policy.wants_series(label):
        return policy.limit_for(label)
    return None
