"""What `outrate top` reads: one /metrics page -> a `Snapshot`, two -> `Row`s.

The figures are the engine's own counters (measured where the decisions are
made), differenced between two scrapes. Fetch, parse and diff are separate
small functions over a `Snapshot`, so tests feed them what prometheus_client
really prints and a fake clock.

Separate from the screen (`outrate.observe.top`: rich, the table, the redraw
loop) because this is the part other code reuses: anything that wants the
engine's figures from its page (a test waiting for a reload, a script) reads
them here, without a terminal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from time import monotonic
from typing import NamedTuple

from outrate.errors import OutrateError
from outrate.observe.fetch import PageError, fetch, metric_families

Clock = Callable[[], float]

PREFIX = "outrate_"

LIMIT_SAMPLES: Mapping[str, str] = {
    "outrate_output_tokens_total": "tokens",
    "outrate_borrowed_tokens_total": "borrowed_tokens",
    "outrate_held_requests": "held",
    "outrate_live_requests": "live",
    "outrate_throttled_seconds_total": "throttled_seconds",
    "outrate_shadow_over_limit_tokens_total": "shadow_over_tokens",
    "outrate_limit_tokens_per_second": "rate_limit",
    "outrate_limit_peak_tokens_per_second": "peak",
    "outrate_prompt_tokens_total": "prompt_tokens",
    "outrate_limit_prompt_tokens_per_second": "prompt_limit",
    "outrate_prompt_waiting_requests": "prompt_waiting",
}
"""Samples labelled by `limit`: sample name -> `LimitValues` field."""
REFUSED_SAMPLE = "outrate_requests_refused_total"
REFUSED_FIELDS: Mapping[str, str] = {"requests": "refused_requests", "quota": "refused_quota"}
"""The API server's 429s, labelled `limit` and `reason`: reason -> `LimitValues` field."""

NO_METRICS = "has no outrate metrics: is the server running with --outrate-policy?"


class TopError(OutrateError):
    """The metrics page cannot be read, or has nothing of outrate's on it."""


@dataclass(frozen=True, slots=True)
class LimitValues:
    """One limit's samples in one scrape; None where the page has no such sample."""

    tokens: float | None = None
    held: float | None = None
    live: float | None = None
    throttled_seconds: float | None = None
    shadow_over_tokens: float | None = None
    rate_limit: float | None = None  # tok/s; inf = unlimited
    mode: str | None = None  # enforce | shadow
    borrowed_tokens: float | None = None  # of `tokens`, those borrowed over the rate
    peak: float | None = None  # tok/s, rate plus borrowing; inf = unlimited
    prompt_tokens: float | None = None  # prompt tokens computed and charged
    prompt_limit: float | None = None  # configured prompt tok/s; inf = unlimited
    prompt_waiting: float | None = None  # requests waiting for prompt budget now
    refused_requests: float | None = None  # 429s over the request rate (a counter)
    refused_quota: float | None = None  # 429s for a spent quota (a counter)


CONFIGURED = ("rate_limit", "peak", "prompt_limit")
"""`LimitValues` fields that are configured values, the same on every series
of a limit: taken as they are, never added up."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything `top` shows, from one scrape taken at `at` (clock seconds)."""

    at: float
    limits: Mapping[str, LimitValues]
    samples: int  # outrate_* samples on the page; 0: the server runs without outrate
    policy_sha256: str | None = None
    policy_source: str | None = None
    reloads: Mapping[str, float] | None = None  # result -> count
    displaced: float | None = None
    deferred: Mapping[str, float] | None = None  # reason -> count


class Row(NamedTuple):
    """One limit over the interval between two snapshots; None prints as `-`."""

    limit: str
    rate: float | None  # tok/s charged
    rate_limit: float | None  # configured tok/s, inf = unlimited
    mode: str | None
    held: float | None  # requests held now: whole, or what the page says (inf, nan)
    live: float | None  # requests in the engine now
    throttled: float | None  # share of live request-time spent held, in [0, 1]
    shadow_over: float | None  # tok/s a shadow rule would have refused
    # Last and defaulted: code that builds a Row by position keeps working.
    borrowed: float | None = None  # of `rate`, tok/s borrowed from spare capacity
    peak: float | None = None  # configured tok/s with borrowing, inf = unlimited
    prompt: float | None = None  # prompt tok/s computed and charged
    prompt_limit: float | None = None  # configured prompt tok/s, inf = unlimited
    prompt_waiting: float | None = None  # requests waiting for prompt budget now
    refused: float | None = None  # requests/s refused with 429 over the request rate
    quota_refused: float | None = None  # requests/s refused with 429 for a spent quota


def metrics_url(url: str) -> str:
    """The /metrics URL of a server given as its root, host:port, or the full URL."""
    if "://" not in url:
        url = "http://" + url
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise TopError(f"{url}: not an http(s) URL")
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def parse(text: str, at: float) -> Snapshot:
    """The outrate samples of a Prometheus text page; everything else is ignored.

    Series that differ only in labels other than `limit` (an `engine` label,
    should one appear) are added up, except the configured rates and peak,
    which are the same everywhere (`CONFIGURED`). `_created` samples have
    their own names and fall through.
    """
    families = metric_families(text, TopError)
    values: dict[str, dict[str, float]] = {}
    modes: dict[str, str] = {}
    reloads: dict[str, float] = {}
    deferred: dict[str, float] = {}
    sha256 = source = None
    displaced: float | None = None
    samples = 0
    for family in families:
        for s in family.samples:
            if not s.name.startswith(PREFIX):
                continue
            samples += 1
            field = LIMIT_SAMPLES.get(s.name)
            if s.name == REFUSED_SAMPLE:
                field = REFUSED_FIELDS.get(s.labels.get("reason", ""))
            if field is not None:
                limit = s.labels.get("limit")
                if limit is None:
                    continue
                fields = values.setdefault(limit, {})
                if field in CONFIGURED:
                    fields[field] = s.value
                    if "mode" in s.labels:
                        modes[limit] = s.labels["mode"]
                else:
                    fields[field] = fields.get(field, 0.0) + s.value
            elif s.name == "outrate_policy_info":
                if s.value > 0 or sha256 is None:
                    sha256, source = s.labels.get("sha256"), s.labels.get("source")
            elif s.name == "outrate_policy_reloads_total":
                _add(reloads, s.labels.get("result", ""), s.value)
            elif s.name == "outrate_deferred_total":
                _add(deferred, s.labels.get("reason", ""), s.value)
            elif s.name == "outrate_displaced_total":
                displaced = (displaced or 0.0) + s.value
    limits = {
        name: LimitValues(
            tokens=fields.get("tokens"),
            held=fields.get("held"),
            live=fields.get("live"),
            throttled_seconds=fields.get("throttled_seconds"),
            shadow_over_tokens=fields.get("shadow_over_tokens"),
            rate_limit=fields.get("rate_limit"),
            mode=modes.get(name),
            borrowed_tokens=fields.get("borrowed_tokens"),
            peak=fields.get("peak"),
            prompt_tokens=fields.get("prompt_tokens"),
            prompt_limit=fields.get("prompt_limit"),
            prompt_waiting=fields.get("prompt_waiting"),
            refused_requests=fields.get("refused_requests"),
            refused_quota=fields.get("refused_quota"),
        )
        for name, fields in values.items()
    }
    return Snapshot(
        at=at,
        limits=limits,
        samples=samples,
        policy_sha256=sha256,
        policy_source=source,
        reloads=reloads or None,
        displaced=displaced,
        deferred=deferred or None,
    )


def _add(into: dict[str, float], key: str, value: float) -> None:
    into[key] = into.get(key, 0.0) + value


def scrape(url: str, timeout: float, clock: Clock | None = None) -> Snapshot:
    """Fetch and parse `url` (a /metrics URL); a page without outrate is an error."""
    now = clock or monotonic
    before = now()
    try:
        text = fetch(url, timeout)
    except PageError as e:
        raise TopError(str(e)) from e
    at = (before + now()) / 2  # the server rendered the page somewhere in between
    try:
        snapshot = parse(text, at)
    except TopError as e:
        raise TopError(f"{url} {e}") from e
    if snapshot.samples == 0:
        raise TopError(f"{url} {NO_METRICS}")
    return snapshot


def rows(prev: Snapshot | None, cur: Snapshot, limit_filter: str | None = None) -> list[Row]:
    """Per limit, what happened between `prev` and `cur`; most throttled first.

    Without `prev` (the first frame) only the gauges are known. A series
    missing from `prev` started in between, so it counts from 0; a counter
    that went down means the engine restarted, so it counts from 0 as well.
    """
    dt = cur.at - prev.at if prev is not None else 0.0
    out = []
    for limit, now in cur.limits.items():
        if limit_filter is not None and not fnmatchcase(limit, limit_filter):
            continue
        rate = throttled = shadow_over = borrowed = prompt = refused = quota_refused = None
        if prev is not None and dt > 0:
            before = prev.limits.get(limit, NOTHING)
            rate = _per_second(before.tokens, now.tokens, dt)
            borrowed = _per_second(before.borrowed_tokens, now.borrowed_tokens, dt)
            shadow_over = _per_second(before.shadow_over_tokens, now.shadow_over_tokens, dt)
            prompt = _per_second(before.prompt_tokens, now.prompt_tokens, dt)
            refused = _per_second(before.refused_requests, now.refused_requests, dt)
            quota_refused = _per_second(before.refused_quota, now.refused_quota, dt)
            held_for = _increase(before.throttled_seconds, now.throttled_seconds)
            if held_for is not None and now.live:  # live 0 or absent: nothing to share
                throttled = min(max(held_for / (dt * now.live), 0.0), 1.0)
        out.append(
            Row(
                limit=limit,
                rate=rate,
                rate_limit=now.rate_limit,
                mode=now.mode,
                held=_count(now.held),
                live=_count(now.live),
                throttled=throttled,
                shadow_over=shadow_over,
                borrowed=borrowed,
                peak=now.peak,
                prompt=prompt,
                prompt_limit=now.prompt_limit,
                prompt_waiting=_count(now.prompt_waiting),
                refused=refused,
                quota_refused=quota_refused,
            )
        )
    out.sort(key=lambda r: (-_or(r.throttled), -_or(r.rate), r.limit))
    return out


NOTHING = LimitValues()


def _increase(before: float | None, now: float | None) -> float | None:
    if now is None:
        return None
    start = before or 0.0
    return now - start if now >= start else now


def _per_second(before: float | None, now: float | None, dt: float) -> float | None:
    increase = _increase(before, now)
    return None if increase is None else increase / dt


def _count(value: float | None) -> float | None:
    """A gauge of requests, whole; a non-finite one (a page may say +Inf) as it is."""
    return round(value) if value is not None and math.isfinite(value) else value


def _or(value: float | None) -> float:
    return -1.0 if value is None or math.isnan(value) else value
