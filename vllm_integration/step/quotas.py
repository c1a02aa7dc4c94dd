"""Counting quota usage in the engine core (`quota:`; outrate.budget.quota).

What counts: every output token a request produced (`num_output_tokens`,
after the model ran: never the async look-ahead nor a refunded dispatch)
and, once per request, its prompt tokens as sent (prefix-cache hits
included: a quota is a bill for what was asked, not a cost of the step).
The scheduler folds them into the `QuotaBook` every `FOLD_INTERVAL_NS` on
its own thread (O(live requests), never per token) and once more when a
request is freed; the `QuotaSaver` thread writes the book to the quota
file. Nothing here refuses anything: a stream in progress is never cut, and
the API server refuses a spent user's next request.

Usage is counted for every user in each (kind, window) that some rule of
the policy has a quota on, so a reload that gives a user a quota, or
changes its amount, keeps what was already counted in that window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from outrate.budget.quota import QuotaBook
from outrate.policy.compiler import CompiledPolicy
from vllm_integration.step.state import ATTR

FOLD_INTERVAL_NS = 250_000_000
SEEN = "_outrate_quota_seen"
"""On a request: the output tokens already counted (absent: its prompt not yet)."""


def quota_windows(policy: CompiledPolicy) -> dict[str, tuple[str, ...]]:
    """kind -> the windows some rule has a quota of that kind over."""
    out: dict[str, set[str]] = {}
    for lim in policy.all_limits():
        for q in lim.quotas:
            out.setdefault(q.kind, set()).add(q.window)
    return {kind: tuple(sorted(ws)) for kind, ws in out.items()}


class QuotaMeter:
    """The scheduler's side of the quota book."""

    def __init__(self, book: QuotaBook, policy: CompiledPolicy) -> None:
        self.book = book
        self.windows = quota_windows(policy)
        self.next_ns = 0

    def set_policy(self, policy: CompiledPolicy) -> None:
        self.windows = quota_windows(policy)

    def fold(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.count(request)

    def count(self, request: Any) -> None:
        """Add what `request` produced since it was last counted."""
        rs = request.__dict__.get(ATTR)
        if rs is None or not self.windows:
            return
        d = request.__dict__
        seen = d.get(SEEN)
        key = rs.user.key
        if seen is None:
            seen = 0
            windows = self.windows.get("prompt")
            if windows:
                self.book.add(key, "prompt", request.num_prompt_tokens, windows)
        out = request.num_output_tokens
        if out > seen:
            windows = self.windows.get("output")
            if windows:
                self.book.add(key, "output", out - seen, windows)
        d[SEEN] = max(out, seen)
