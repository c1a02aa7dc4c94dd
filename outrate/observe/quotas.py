"""Quota usage on /metrics: each `limit` label's usage of the quotas in force,
read from the engine's `QuotaBook` by the metrics publisher's thread.

Labels are the token metrics' (outrate.observe.metrics): a user listed in
the policy, or opted in with `metrics.per_user` and given a series, is its
own label; everyone else is counted under its rule's label (`default`,
`tier:NAME`, `match:PATTERN`) or `other`, so the series stay as many as the
token metrics' times the (kind, window) pairs in use (at most 8). Under a
rule's label the usage is the sum over its users, the quota is one user's,
and `spent` says how many of its users have none left.

The book belongs to the scheduler thread: this reads it without locking
(whole-dict copies and single reads, as `QuotaBook.snapshot` does for the
saver) and resolves labels with `Metrics.label_known`, which never hands
out a series. O(users with usage) per snapshot, off the scheduler thread.
"""

from __future__ import annotations

from typing import Any

from outrate.budget.quota import QuotaBook, used_in
from outrate.observe.metrics import Metrics, limit_of_label
from outrate.policy.compiler import CompiledPolicy

QuotaRows = dict[str, dict[str, dict[str, int]]]
"""label -> `"output/day"` -> {"used": tokens, "spent": users, "quota": tokens per user}
(`quota` absent where the label's rule has no quota of that kind and window)."""


def quota_usage(book: QuotaBook, metrics: Metrics, policy: CompiledPolicy) -> QuotaRows:
    """The current windows' usage per label, and each label's quota in force."""
    now = book.clock()
    rows: QuotaRows = {}
    for user, usage in list(book.users.items()):
        label = metrics.label_known(user, policy)
        for q in policy.limit_for(user).quotas:  # the quotas in force, not all it counts
            used = used_in(usage, q.kind, q.window, now)
            if not used:
                continue  # none yet, or a window that has passed
            key = f"{q.kind}/{q.window}"
            row = rows.setdefault(label, {}).setdefault(key, {"used": 0, "spent": 0})
            row["used"] += used
            row["spent"] += used >= q.tokens
    labels = {*rows, *metrics.labels, "default", "anonymous"}
    labels |= {f"tier:{t}" for t in policy.tiers} | {f"match:{p}" for p, _ in policy.patterns}
    for label in labels:
        lim = limit_of_label(label, policy)
        if lim is None:
            continue
        for q in lim.quotas:  # a configured quota shows before its first token
            row = rows.setdefault(label, {}).setdefault(
                f"{q.kind}/{q.window}", {"used": 0, "spent": 0}
            )
            row["quota"] = q.tokens
    return rows


def merge_quota(into: dict[str, Any], rows: dict[str, Any]) -> None:
    """Several engines' rows (data parallel) on one page: usage and spent
    users add up; the quota is the same everywhere."""
    for label, keys in rows.items():
        mine = into.setdefault(label, {})
        for key, row in keys.items():
            if key not in mine:
                mine[key] = dict(row)
                continue
            mine[key]["used"] += row["used"]
            mine[key]["spent"] += row["spent"]
