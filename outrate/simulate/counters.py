"""vLLM's counters, from its /metrics page or from a Prometheus that scrapes
it: what `simulate calibrate --metrics` fits the step model to (metricsfit).

Between two readings, the counters say how many steps an engine took and
what those steps computed:

    steps           vllm:iteration_tokens_total_count (one per step with output)
    tokens decoded  vllm:inter_token_latency_seconds_count (one per token a
                    request got after its first: a decoding request, per step)
    prompt tokens   vllm:iteration_tokens_total_sum - vllm:generation_tokens_total
                    (the histogram observes a step's computed prompt tokens,
                    prefix-cache hits left out as the simulator leaves them,
                    plus its generated ones)

with `vllm:num_requests_running` (a gauge) and the inter-token latency's sum
beside them. Two places to read them from: the engine's page (a URL ending
in /metrics), scraped every `interval` seconds for `window` seconds
(`scrape_engine`); or a Prometheus server (any other URL), the last
`window` seconds of what it stored, one reading per scrape it took
(`read_prometheus`). Series are told apart by their labels (vLLM's
`engine`, Prometheus's `instance`). Fetch and clock are parameters, so
tests feed pages that prometheus_client printed and never sleep.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from time import monotonic_ns, sleep
from time import time as wall_time
from typing import Any

from outrate.errors import OutrateError
from outrate.observe.fetch import fetch, metric_families

Fetch = Callable[[str, float], str]
"""(url, timeout in seconds) -> the page's text: `outrate.observe.fetch.fetch`."""

COUNTERS: Mapping[str, str] = {
    "vllm:iteration_tokens_total_count": "steps",
    "vllm:iteration_tokens_total_sum": "tokens",
    "vllm:generation_tokens_total": "generated",
    "vllm:inter_token_latency_seconds_count": "decoded",
    "vllm:inter_token_latency_seconds_sum": "itl_seconds",
}
"""Sample name -> `Reading` field."""

RUNNING = "vllm:num_requests_running"
STEPS = "vllm:iteration_tokens_total_count"
NOT_VLLM = f"has no {STEPS}: not a vLLM /metrics page (or the engine runs with --disable-log-stats)"


class MetricsError(OutrateError):
    """The metrics cannot be read, are not vLLM's, or cannot be fitted."""


@dataclass(frozen=True, slots=True)
class Reading:
    """One engine's counters at one time."""

    series: str
    """The labels that tell engines apart (`engine="0",model_name="m"`)."""
    at_ns: int
    steps: float
    tokens: float
    generated: float
    decoded: float
    itl_seconds: float
    running: float | None = None
    """Requests running (a gauge); None where the page has none."""


def engine_page(url: str) -> bool:
    """An engine's own page (ends in /metrics), not a Prometheus server."""
    return urllib.parse.urlsplit(url).path.rstrip("/").endswith("/metrics")


def parse_page(text: str, at_ns: int) -> list[Reading]:
    """The counters of a vLLM /metrics page, one `Reading` per engine series."""
    families = metric_families(text, MetricsError)
    values: dict[str, dict[str, float]] = {}
    running: dict[str, float] = {}
    for family in families:
        for s in family.samples:
            if s.name in COUNTERS:
                values.setdefault(_series(s.labels), {})[COUNTERS[s.name]] = s.value
            elif s.name == RUNNING:
                running[_series(s.labels)] = s.value
    if not any("steps" in v for v in values.values()):
        raise MetricsError(NOT_VLLM)
    return [_reading(series, at_ns, v, running.get(series)) for series, v in sorted(values.items())]


def _reading(
    series: str, at_ns: int, values: Mapping[str, float], running: float | None
) -> Reading:
    missing = [name for name, f in COUNTERS.items() if f not in values]
    if missing:
        where = f" ({series})" if series else ""
        raise MetricsError(f"has no {missing[0]}{where}: not vLLM V1's metrics")
    return Reading(
        series=series,
        at_ns=at_ns,
        steps=values["steps"],
        tokens=values["tokens"],
        generated=values["generated"],
        decoded=values["decoded"],
        itl_seconds=values["itl_seconds"],
        running=running,
    )


def _series(labels: Mapping[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k not in ("le", "__name__"))


def scrape_engine(
    url: str,
    window_s: float,
    interval_s: float,
    *,
    fetch_page: Fetch | None = None,
    clock: Callable[[], int] | None = None,
    wait: Callable[[float], None] | None = None,
    timeout_s: float = 5.0,
) -> list[Reading]:
    """Read an engine's /metrics now and every `interval_s` until `window_s`
    has passed. A page that cannot be read, or is not vLLM's, fails at once."""
    get, now, pause = fetch_page or fetch, clock or monotonic_ns, wait or sleep
    step_ns = max(int(interval_s * 1e9), 1)
    readings: list[Reading] = []
    due = now()
    end_ns = due + int(window_s * 1e9)
    while due <= end_ns:
        before = now()
        text = get(url, timeout_s)
        at = (before + now()) // 2  # the server rendered the page somewhere in between
        try:
            readings += parse_page(text, at)
        except MetricsError as e:
            raise MetricsError(f"{url} {e}") from e
        due += step_ns
        while due < now():  # a scrape slower than the interval: the next one is now
            due += step_ns
        if due <= end_ns:
            pause((due - now()) / 1e9)
    return readings


def read_prometheus(
    base: str,
    window_s: float,
    interval_s: float,
    match: str | None = None,
    *,
    fetch_page: Fetch | None = None,
    clock: Callable[[], float] | None = None,
    timeout_s: float = 10.0,
) -> list[Reading]:
    """The same counters from a Prometheus server (its base URL), over the
    last `window_s`: a range query per counter, and `timestamp()` for when
    Prometheus scraped each value, so an interval is the time between two of
    its scrapes (a query step shorter than its scrape interval repeats one)."""
    get = fetch_page or fetch
    end = (clock or wall_time)()
    step = max(interval_s, window_s / 10_000)  # Prometheus answers 11,000 points a series at most
    selector = match or ""
    queries = {f: f"{name}{selector}" for name, f in COUNTERS.items()}
    queries["running"] = f"{RUNNING}{selector}"
    queries["at"] = f"timestamp({STEPS}{selector})"
    table: dict[str, dict[float, dict[str, float]]] = {}
    for column, query in queries.items():
        args = {"query": query, "start": f"{end - window_s:.3f}", "end": f"{end:.3f}", "step": step}
        url = f"{base.rstrip('/')}/api/v1/query_range?{urllib.parse.urlencode(args)}"
        try:
            text = get(url, timeout_s)
        except OutrateError as e:
            raise MetricsError(
                f"{e} (read as a Prometheus server: an engine's own page ends in /metrics)"
            ) from e
        for labels, values in _matrix(url, text):
            rows = table.setdefault(_series(labels), {})
            for t, v in values:
                rows.setdefault(float(t), {})[column] = float(v)
    readings: list[Reading] = []
    for series, rows in sorted(table.items()):
        last = None
        for _, row in sorted(rows.items()):
            if "at" not in row or "steps" not in row or row["at"] == last:
                continue  # no sample then, or the same scrape again
            last = row["at"]
            try:
                readings.append(_reading(series, int(row["at"] * 1e9), row, row.get("running")))
            except MetricsError as e:
                raise MetricsError(f"{base}: {e}") from e
    if not readings:
        raise MetricsError(
            f"{base}: no {STEPS}{selector} in the last {window_s:g}s: is Prometheus scraping "
            "a vLLM engine (and is --match right)? An engine's own page ends in /metrics."
        )
    return readings


def _matrix(url: str, text: str) -> list[tuple[dict[str, str], list[list[Any]]]]:
    """The series of a range query's answer."""
    not_api = f"{url}: not a Prometheus API answer (an engine's own page ends in /metrics)"
    try:
        data = json.loads(text)
    except ValueError as e:
        raise MetricsError(not_api) from e
    if not isinstance(data, dict) or data.get("status") != "success":
        said = data.get("error", data.get("status")) if isinstance(data, dict) else None
        raise MetricsError(f"{url}: Prometheus says {said}" if said else not_api)
    try:
        return [(r["metric"], r["values"]) for r in data["data"]["result"]]
    except (KeyError, TypeError) as e:
        raise MetricsError(not_api) from e


def read_metrics(
    url: str, window_s: float, interval_s: float, match: str | None = None
) -> list[Reading]:
    """An engine's page scraped over the window, or a Prometheus read back over
    it. `match`: a label selector for Prometheus's series (`{instance="e:8000"}`)."""
    if "://" not in url:
        url = "http://" + url
    if engine_page(url):
        if match is not None:
            raise MetricsError(f"{url}: --match selects a Prometheus's series, not a page's")
        return scrape_engine(url, window_s, interval_s)
    if match is not None and not (match.startswith("{") and match.endswith("}")):
        raise MetricsError(
            f"--match {match!r}: a PromQL label selector, like '{{instance=\"engine:8000\"}}'"
        )
    return read_prometheus(url, window_s, interval_s, match)
