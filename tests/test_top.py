"""`outrate top`: parse and diff what prometheus_client really prints (`_created`
samples, histograms and vLLM's own metrics on the same page), the table
`--once` prints against a real HTTP server, and each error's exact line and
exit code. A fake clock makes the rates exact; nothing sleeps for real."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from rich.console import Console
from typer.testing import CliRunner

from outrate.cli import app
from outrate.observe import top
from outrate.observe.fetch import MAX_PAGE_BYTES
from outrate.observe.top import LimitValues, Row, Snapshot, TopError

pytestmark = pytest.mark.waits  # make test's waits lane (tests/lanes.py)

ROOT = Path(__file__).parent.parent
INF = float("inf")
SHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
SOURCE = "/etc/outrate/policy.yaml"
CREATED = 1_700_000_000.0


@dataclass(eq=False)  # a collector is registered by identity
class Engine(Collector):
    """What outrate's scheduler reports, rendered by prometheus_client itself."""

    tokens: dict[str, float]
    held: dict[str, float]
    live: dict[str, float]
    throttled: dict[str, float]
    limits: dict[str, tuple[float, str]]
    shadow_over: dict[str, float]
    borrowed: dict[str, float] = field(default_factory=dict)  # 0 for the others, as outrate's
    peaks: dict[str, float] = field(default_factory=dict)  # mode: the limit's
    # Prompt limits (none: an engine from before them, no such series at all)
    prompt: dict[str, float] = field(default_factory=dict)
    prompt_limits: dict[str, float] = field(default_factory=dict)  # mode: the limit's
    prompt_waiting: dict[str, float] = field(default_factory=dict)
    displaced: float = 0.0
    deferred: dict[str, float] = field(default_factory=lambda: {"max_streams": 0, "budget": 2})
    reloads: dict[str, float] = field(default_factory=lambda: {"applied": 1, "rejected": 0})
    outrate: bool = True  # False: a server started without --outrate-policy

    def collect(self) -> Iterator[Metric]:
        yield from self._vllm()
        if not self.outrate:
            return
        yield _counter(
            "outrate_output_tokens",
            "Output tokens charged to the limit, net of refunds.",
            self.tokens,
        )
        yield _counter(
            "outrate_borrowed_tokens",
            "Output tokens borrowed from spare capacity.",
            {limit: self.borrowed.get(limit, 0.0) for limit in self.tokens},
        )
        yield _gauge("outrate_held_requests", "Requests held.", self.held)
        yield _gauge("outrate_live_requests", "Requests in the engine.", self.live)
        yield _counter("outrate_throttled_seconds", "Request-seconds held.", self.throttled)
        rate = GaugeMetricFamily(
            "outrate_limit_tokens_per_second", "Configured rate.", labels=["limit", "mode"]
        )
        for limit, (tok_s, mode) in self.limits.items():
            rate.add_metric([limit, mode], tok_s)
        yield rate
        peak = GaugeMetricFamily(
            "outrate_limit_peak_tokens_per_second", "Peak.", labels=["limit", "mode"]
        )
        for limit, tok_s in self.peaks.items():
            peak.add_metric([limit, self.limits[limit][1]], tok_s)
        yield peak
        yield _counter(
            "outrate_shadow_over_limit_tokens", "Shadow over-limit tokens.", self.shadow_over
        )
        if self.prompt:
            yield _counter("outrate_prompt_tokens", "Prompt tokens.", self.prompt)
            prompt_rate = GaugeMetricFamily(
                "outrate_limit_prompt_tokens_per_second", "Prompt rate.", labels=["limit", "mode"]
            )
            for limit, tok_s in self.prompt_limits.items():
                prompt_rate.add_metric([limit, self.limits[limit][1]], tok_s)
            yield prompt_rate
            yield _gauge("outrate_prompt_waiting_requests", "Prompt waits.", self.prompt_waiting)
        for name in ("outrate_budget_wait_seconds", "outrate_token_interval_seconds"):
            histogram = HistogramMetricFamily(name, "Seconds.", labels=["limit"])
            for limit in self.tokens:
                buckets = [("0.001", 1.0), ("0.1", 4.0), ("+Inf", 9.0)]
                histogram.add_metric([limit], buckets, sum_value=3.5)
            yield histogram
        displaced = CounterMetricFamily("outrate_displaced", "Displaced.")
        displaced.add_metric([], self.displaced, created=CREATED)
        yield displaced
        yield _counter("outrate_deferred", "Deferred.", self.deferred, label="reason")
        yield _counter("outrate_policy_reloads", "Reloads.", self.reloads, label="result")
        info = GaugeMetricFamily("outrate_policy_info", "Policy.", labels=["sha256", "source"])
        info.add_metric([SHA, SOURCE], 1.0)
        yield info

    def _vllm(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Running.", labels=["engine", "model_name"]
        )
        running.add_metric(["0", "tiny"], 7.0)
        yield running
        generated = CounterMetricFamily(
            "vllm:generation_tokens", "Generated.", labels=["engine", "model_name"]
        )
        generated.add_metric(["0", "tiny"], 5000.0, created=CREATED)
        yield generated

    def page(self) -> str:
        registry = CollectorRegistry()
        registry.register(self)
        return generate_latest(registry).decode()


def _counter(name: str, doc: str, values: dict[str, float], label: str = "limit") -> Metric:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value, created=CREATED)
    return family


def _gauge(name: str, doc: str, values: dict[str, float]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["limit"])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


BEFORE = Engine(
    tokens={"alice": 1234, "tier:pro": 99, "default": 5, "anonymous": 0, "other": 10},
    held={"alice": 3, "tier:pro": 0, "default": 0, "anonymous": 0, "other": 1},
    live={"alice": 4, "tier:pro": 2, "default": 0, "anonymous": 0, "other": 1},
    throttled={"alice": 12.5, "tier:pro": 1.0, "default": 0, "anonymous": 0, "other": 0},
    limits={
        "alice": (20.0, "enforce"),
        "tier:pro": (20.0, "enforce"),
        "default": (float("inf"), "shadow"),
        "anonymous": (0.5, "enforce"),
    },
    shadow_over={"default": 0},
    borrowed={"tier:pro": 9},
    # tier:pro borrows up to 50; the others have no peak: it is their rate
    peaks={"alice": 20.0, "tier:pro": 50.0, "default": float("inf"), "anonymous": 0.5},
    prompt={"alice": 4000, "tier:pro": 100, "default": 0, "anonymous": 0, "other": 0},
    # alice's prompts are limited, tier:pro's and the shadow default's are not
    prompt_limits={
        "alice": 500.0,
        "tier:pro": float("inf"),
        "default": float("inf"),
        "anonymous": 200.0,
    },
    prompt_waiting={"alice": 1, "tier:pro": 0, "default": 0, "anonymous": 0, "other": 0},
)
"""The first scrape."""

AFTER = replace(
    BEFORE,
    # 2 s later; bob's series starts in between, so it counts from 0.
    tokens={"alice": 1274, "tier:pro": 159, "default": 5, "anonymous": 0, "other": 31, "bob": 8},
    held={"alice": 3, "tier:pro": 0, "default": 0, "anonymous": 0, "other": 1, "bob": 1},
    live={"alice": 4, "tier:pro": 2, "default": 0, "anonymous": 0, "other": 1, "bob": 1},
    throttled={
        "alice": 18.5,
        "tier:pro": 2.0,
        "default": 0,
        "anonymous": 0,
        "other": 5,
        "bob": 0.5,
    },
    shadow_over={"default": 7},
    borrowed={"tier:pro": 29},
    displaced=1.0,
    prompt={"alice": 5000, "tier:pro": 300, "default": 0, "anonymous": 0, "other": 0, "bob": 50},
    prompt_waiting={
        "alice": 2,
        "tier:pro": 0,
        "default": 0,
        "anonymous": 0,
        "other": 0,
        "bob": 0,
    },
)
"""The second scrape, 2 s after the first."""

EXPECTED_ROWS = [
    # other: 5 s held in 2 s with 1 live request is more than all of it: clipped to 1.
    Row("other", 10.5, None, None, 1, 1, 1.0, None, 0.0, None, 0.0, None, 0),
    # 6 s held / (2 s x 4); its prompts at their 500 tok/s, 2 requests waiting for more
    Row("alice", 20.0, 20.0, "enforce", 3, 4, 0.75, None, 0.0, 20.0, 500.0, 500.0, 2),
    # 1 s held / (2 s x 2); 20 tok/s committed and 10 borrowed, short of its peak
    Row("tier:pro", 30.0, 20.0, "enforce", 0, 2, 0.25, None, 10.0, 50.0, 100.0, INF, 0),
    Row("bob", 4.0, None, None, 1, 1, 0.25, None, 0.0, None, 25.0, None, 0),  # ties tier:pro
    # no live requests: no share
    Row("anonymous", 0.0, 0.5, "enforce", 0, 0, None, None, 0.0, 0.5, 0.0, 200.0, 0),
    Row("default", 0.0, INF, "shadow", 0, 0, None, 3.5, 0.0, INF, 0.0, INF, 0),
]

EXPECTED_TABLE = f"""\
outrate top {{url}} (rates over 2.00s)
policy 9f86d081884c ({SOURCE}); reloads: 1 applied, 0 rejected; displaced: 1; deferred: budget 2, max_streams 0
limit      rate tok/s  borrowed tok/s  limit tok/s  peak tok/s  mode     held  live  throttled  shadow over tok/s  prompt tok/s  prompt limit tok/s  prompt waiting  429 requests/s  429 quota/s
other            10.5             0.0            -           -  -           1     1       100%                  -           0.0                   -               0               -            -
alice            20.0             0.0           20          20  enforce     3     4        75%                  -         500.0                 500               2               -            -
tier:pro         30.0            10.0           20          50  enforce     0     2        25%                  -         100.0           unlimited               0               -            -
bob               4.0             0.0            -           -  -           1     1        25%                  -          25.0                   -               0               -            -
anonymous         0.0             0.0          0.5         0.5  enforce     0     0          -                  -           0.0                 200               0               -            -
default           0.0             0.0    unlimited   unlimited  shadow      0     0          -                3.5           0.0           unlimited               0               -            -
"""  # noqa: E501


# --- parse -------------------------------------------------------------------------------


def test_the_page_is_what_prometheus_client_prints() -> None:
    page = BEFORE.page()
    assert 'outrate_output_tokens_total{limit="alice"} 1234.0' in page
    assert 'outrate_output_tokens_created{limit="alice"} 1.7e+09' in page
    assert 'outrate_limit_tokens_per_second{limit="default",mode="shadow"} +Inf' in page
    assert 'outrate_budget_wait_seconds_bucket{le="+Inf",limit="alice"} 9.0' in page
    assert "outrate_displaced_total 0.0" in page
    assert 'vllm:generation_tokens_created{engine="0",model_name="tiny"}' in page


def test_parse_keeps_outrate_samples_only() -> None:
    snapshot = top.parse(BEFORE.page(), at=10.0)
    assert snapshot.at == 10.0
    assert snapshot.limits == {
        "alice": LimitValues(1234, 3, 4, 12.5, None, 20.0, "enforce", 0, 20.0, 4000, 500.0, 1),
        "tier:pro": LimitValues(99, 0, 2, 1.0, None, 20.0, "enforce", 9, 50.0, 100, INF, 0),
        "default": LimitValues(5, 0, 0, 0, 0, INF, "shadow", 0, INF, 0, INF, 0),
        "anonymous": LimitValues(0, 0, 0, 0, None, 0.5, "enforce", 0, 0.5, 0, 200.0, 0),
        "other": LimitValues(10, 1, 1, 0, None, None, None, 0, None, 0, None, 0),
    }
    assert snapshot.policy_sha256 == SHA and snapshot.policy_source == SOURCE
    assert snapshot.reloads == {"applied": 1, "rejected": 0}
    assert snapshot.deferred == {"max_streams": 0, "budget": 2}
    assert snapshot.displaced == 0


def test_parse_a_page_without_outrate() -> None:
    snapshot = top.parse(replace(BEFORE, outrate=False).page(), at=0.0)
    assert snapshot.samples == 0 and snapshot.limits == {}


def test_parse_adds_up_series_split_by_other_labels() -> None:
    page = (
        'outrate_output_tokens_total{engine="0",limit="alice"} 10.0\n'
        'outrate_output_tokens_total{engine="1",limit="alice"} 5.0\n'
        'outrate_limit_tokens_per_second{engine="0",limit="alice",mode="enforce"} 20.0\n'
        'outrate_limit_tokens_per_second{engine="1",limit="alice",mode="enforce"} 20.0\n'
    )
    assert top.parse(page, 0.0).limits["alice"] == LimitValues(
        tokens=15.0, rate_limit=20.0, mode="enforce"
    )


@pytest.mark.parametrize("page", ["<html><body>Hello</body></html>", '{"detail": "Not Found"}'])
def test_parse_rejects_what_is_not_prometheus_text(page: str) -> None:
    with pytest.raises(TopError, match="^is not a Prometheus metrics page$"):
        top.parse(page, 0.0)


# --- rows and header ---------------------------------------------------------------------


def test_rows_between_two_scrapes() -> None:
    before, after = top.parse(BEFORE.page(), 100.0), top.parse(AFTER.page(), 102.0)
    assert top.rows(before, after) == EXPECTED_ROWS


def test_rows_of_the_first_frame_have_gauges_only() -> None:
    first = top.rows(None, top.parse(BEFORE.page(), 100.0))
    assert first[0] == Row(
        "alice", None, 20.0, "enforce", 3, 4, None, None, None, 20.0, None, 500.0, 1
    )
    assert [r.limit for r in first] == ["alice", "anonymous", "default", "other", "tier:pro"]
    assert all(r.rate is None and r.throttled is None and r.shadow_over is None for r in first)
    assert all(r.borrowed is None for r in first)


def _published(alice: str) -> tuple[Any, Callable[[], str]]:
    """A `Metrics` for a policy with `alice` (a users: line) and bob at 40,
    and the /metrics page publish.py makes of it, as a function: the names
    top reads are the names outrate writes."""
    from outrate.observe.metrics import Metrics
    from outrate.observe.publish import families, snapshot
    from outrate.policy.compiler import compile_policy
    from outrate.policy.loader import parse_policy

    text = f"version: 1\ndefault: 10\nusers:\n  {alice}\n  bob: 40\n"
    pol = compile_policy(parse_policy(text, "t.yaml"), "t.yaml", "sha")
    metrics = Metrics()

    def page() -> str:
        data = snapshot(metrics, pol, now=0)

        class Outrate(Collector):
            def collect(self) -> Iterator[Metric]:
                return families(data)

        registry = CollectorRegistry()
        registry.register(Outrate())
        return generate_latest(registry).decode()

    return metrics, page


def test_borrowed_and_peak_from_what_outrate_itself_publishes() -> None:
    """The names top reads are the names publish.py writes: a `Metrics` with
    borrowed tokens, through `snapshot` and `families`, to top's rows."""
    metrics, page = _published("alice: {rate: 20, peak: unlimited}")
    alice = metrics.record("alice")

    before = top.parse(page(), 0.0)
    alice.tokens, alice.borrowed = 90, 50
    metrics.record("bob").tokens = 80
    rows = {r.limit: r for r in top.rows(before, top.parse(page(), 2.0))}
    assert rows["alice"][:3] == ("alice", 45.0, 20.0) and rows["alice"].borrowed == 25.0
    assert rows["alice"].peak == float("inf")
    assert (rows["bob"].rate, rows["bob"].borrowed, rows["bob"].peak) == (40.0, 0.0, 40.0)
    assert rows["default"].peak == 10.0  # no peak: the rate


def test_a_server_without_borrowing_shows_dashes() -> None:
    """A page from an outrate before work-conserving limits has neither the
    borrowed counter nor the peak gauge: `-`, not 0."""
    page = "\n".join(
        line for line in AFTER.page().splitlines() if "borrowed" not in line and "peak" not in line
    )
    before, after = top.parse(page, 0.0), top.parse(page, 2.0)
    (alice,) = top.rows(before, after, limit_filter="alice")
    assert (alice.rate, alice.borrowed, alice.peak) == (0.0, None, None)
    line = _plain(top.render("u", before, after, limit_filter="alice")).splitlines()[3]
    assert line.split()[:10] == ["alice", "0.0", "-", "20", "-", "enforce", "3", "4", "0%", "-"]


def test_a_server_without_prompt_limits_shows_dashes() -> None:
    """A page from an outrate before prompt limits has no prompt series:
    `-` in the three prompt columns, not 0."""
    page = "\n".join(line for line in AFTER.page().splitlines() if "prompt" not in line)
    before, after = top.parse(page, 0.0), top.parse(page, 2.0)
    (alice,) = top.rows(before, after, limit_filter="alice")
    assert (alice.prompt, alice.prompt_limit, alice.prompt_waiting) == (None, None, None)
    line = _plain(top.render("u", before, after, limit_filter="alice")).splitlines()[3]
    assert line.split()[9:13] == ["-", "-", "-", "-"]


def test_refusals_per_limit_and_reason_from_what_the_api_server_counts() -> None:
    """The API server's 429 counter (prometheus_client's, as
    count_requests_over makes it) beside the engine's page: requests refused
    per second over the request rate and for a spent quota, per limit; a
    limit refused before any engine series gets a row of its own; no
    refusals yet is `-`, not 0."""
    from prometheus_client import Counter

    from vllm_integration.apiserver.metrics import REFUSED

    metrics, page = _published("alice: {rate: 20, requests: 5, quota: {output: 1K/day}}")
    metrics.record("alice")
    registry = CollectorRegistry()
    refused = Counter(*REFUSED, ["limit", "reason"], registry=registry)

    def both() -> str:
        return page() + generate_latest(registry).decode()

    before = top.parse(both(), 0.0)
    refused.labels("alice", "requests").inc(6)
    refused.labels("alice", "quota").inc(2)
    refused.labels("tier:batch", "requests").inc(1)
    after = top.parse(both(), 2.0)
    rows = {r.limit: r for r in top.rows(before, after)}
    assert (rows["alice"].refused, rows["alice"].quota_refused) == (3.0, 1.0)
    assert (rows["tier:batch"].refused, rows["tier:batch"].quota_refused) == (0.5, None)
    assert (rows["default"].refused, rows["default"].quota_refused) == (None, None)
    line = _plain(top.render("u", before, after, limit_filter="alice")).splitlines()[3]
    assert line.split()[-2:] == ["3.0", "1.0"]
    header = _plain(top.render("u", before, after)).splitlines()[2]
    assert header.rstrip().endswith("429 requests/s  429 quota/s")


def test_prompt_columns_from_what_outrate_itself_publishes() -> None:
    """The prompt names top reads are the names publish.py writes: prompt
    tokens charged, the prompt limit and requests waiting for prompt budget,
    from a `Metrics` through `snapshot` and `families` to top's rows."""
    metrics, page = _published("alice: {rate: 20, prompt: 500}")
    alice = metrics.record("alice")

    before = top.parse(page(), 0.0)
    alice.prompt, alice.prompt_waiting = 1000, 3
    metrics.record("bob").prompt = 300
    rows = {r.limit: r for r in top.rows(before, top.parse(page(), 2.0))}
    assert (rows["alice"].prompt, rows["alice"].prompt_limit, rows["alice"].prompt_waiting) == (
        500.0,
        500.0,
        3,
    )
    assert (rows["bob"].prompt, rows["bob"].prompt_limit, rows["bob"].prompt_waiting) == (
        150.0,
        INF,
        0,
    )


def test_rows_after_an_engine_restart_count_from_zero() -> None:
    before = top.parse(AFTER.page(), 100.0)
    restarted = replace(BEFORE, tokens={**BEFORE.tokens, "alice": 6}, throttled={"alice": 1.0})
    (alice,) = top.rows(before, top.parse(restarted.page(), 101.0), limit_filter="alice")
    assert (alice.rate, alice.throttled) == (6.0, 0.25)


def test_rows_limit_filter_is_a_glob() -> None:
    before, after = top.parse(BEFORE.page(), 0.0), top.parse(AFTER.page(), 2.0)
    assert [r.limit for r in top.rows(before, after, "tier:*")] == ["tier:pro"]
    assert [r.limit for r in top.rows(before, after, "a*")] == ["alice", "anonymous"]


def test_header() -> None:
    snapshot = top.parse(AFTER.page(), 0.0)
    assert top.header(snapshot) == (
        f"policy 9f86d081884c ({SOURCE}); reloads: 1 applied, 0 rejected; displaced: 1; "
        "deferred: budget 2, max_streams 0"
    )
    assert top.header(Snapshot(at=0.0, limits={}, samples=1)) == (
        "policy -; reloads: -; displaced: -; deferred: -"
    )


def test_render_crops_to_max_rows_and_says_so() -> None:
    before, after = top.parse(BEFORE.page(), 0.0), top.parse(AFTER.page(), 2.0)
    text = _plain(top.render("u", before, after, max_rows=2))
    assert [line.split()[0] for line in text.splitlines()[3:]] == ["other", "alice", "..."]
    assert text.endswith("... 4 more (--limit-filter GLOB)\n")


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/metrics"),
        ("http://127.0.0.1:8000/metrics", "http://127.0.0.1:8000/metrics"),
        ("http://127.0.0.1:8000/metrics/", "http://127.0.0.1:8000/metrics"),
        ("localhost:8000", "http://localhost:8000/metrics"),
        ("https://llm.internal/v1-engine", "https://llm.internal/v1-engine/metrics"),
    ],
)
def test_metrics_url(given: str, url: str) -> None:
    assert top.metrics_url(given) == url


# --- a real HTTP server ------------------------------------------------------------------


class Server:
    """Serves `pages` one per request, then the last again; `status` for HTTP errors."""

    def __init__(self, pages: list[str], status: int = 200) -> None:
        self.pages, self.status = pages, status
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.paths.append(self.path)
                body = server.pages[min(len(server.paths), len(server.pages)) - 1].encode()
                self.send_response(server.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.root = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = self.root + "/metrics"

    def __enter__(self) -> Server:
        threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeTime:
    """`outrate.observe.top`'s clock and sleep: sleeping advances the clock, instantly."""

    def __init__(self, interrupt_after: int | None = None) -> None:
        self.now, self.interrupt_after = 1000.0, interrupt_after
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if self.interrupt_after is not None and len(self.sleeps) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(top, "monotonic", fake.clock)
    monkeypatch.setattr(top, "sleep", fake.sleep)
    return fake


runner = CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["top", *args])
    return result.exit_code, result.stdout, result.stderr


def test_once_prints_one_plain_table(fake_time: FakeTime) -> None:
    with Server([BEFORE.page(), AFTER.page()]) as server:
        code, out, err = run(server.root, "--once", "--interval", "2")
    assert (code, err) == (0, "")
    assert out == EXPECTED_TABLE.format(url=server.url)
    assert "\x1b" not in out
    assert server.paths == ["/metrics", "/metrics"] and fake_time.sleeps == [2.0]


def test_once_with_limit_filter(fake_time: FakeTime) -> None:
    with Server([BEFORE.page(), AFTER.page()]) as server:
        code, out, _ = run(server.url, "--once", "--interval", "2", "--limit-filter", "tier:*")
    assert code == 0
    assert out.splitlines()[3:] == [
        "tier:pro        30.0            10.0           20          50  enforce     0     2"
        "        25%                  -         100.0           unlimited               0"
        "               -            -"
    ]


def test_watch_redraws_until_ctrl_c(fake_time: FakeTime) -> None:
    fake_time.interrupt_after = 2  # two redraws, then Ctrl-C
    with Server([BEFORE.page(), BEFORE.page(), AFTER.page()]) as server:
        code, out, err = run(server.root, "--interval", "2")
    assert (code, err) == (0, "")
    assert fake_time.sleeps == [2.0, 2.0] and len(server.paths) == 3
    # Not a terminal: one frame after the other, like `top -b`.
    first, nothing_yet, last = out.split("\n\n")
    assert first.splitlines()[0] == f"outrate top {server.url} (first scrape)"
    alice = " ".join(nothing_yet.splitlines()[3].split())
    # the same page twice: nothing moved
    assert alice == "alice 0.0 0.0 20 20 enforce 3 4 0% - 0.0 500 1 - -"
    assert last == EXPECTED_TABLE.format(url=server.url)


def test_watch_keeps_the_last_figures_while_the_engine_is_away() -> None:
    fake = FakeTime(interrupt_after=3)
    pages = [BEFORE.page(), AFTER.page(), "oops"]
    console = Console(file=io.StringIO(), width=200)
    with Server(pages) as server, pytest.raises(KeyboardInterrupt):
        top.watch(
            server.url,
            interval=1.0,
            timeout=5.0,
            console=console,
            clock=fake.clock,
            sleep_for=fake.sleep,
        )
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert f"{server.url} is not a Prometheus metrics page; retrying" in out
    assert "alice            40.0" in out  # the last good pair: 40 tokens in 1 s


# --- errors and usage --------------------------------------------------------------------


def test_connection_refused() -> None:
    with socket.socket() as bound:  # bound, not listening: connecting is refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/metrics"
        code, out, err = run(url, "--once")
    assert (code, out) == (1, "")
    assert err == f"outrate top: cannot read {url}: Connection refused\n"


def test_timeout() -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/metrics"
        code, _, err = run(url, "--once", "--timeout", "0.2")
    assert code == 1
    assert err == f"outrate top: cannot read {url}: timed out\n"


def test_http_error() -> None:
    with Server(['{"detail":"Not Found"}'], status=404) as server:
        code, out, err = run(server.root)
    assert (code, out) == (1, "")
    assert err == f"outrate top: cannot read {server.url}: HTTP 404 Not Found\n"


def test_server_without_outrate(fake_time: FakeTime) -> None:
    with Server([replace(BEFORE, outrate=False).page()]) as server:
        code, out, err = run(server.root, "--once")
    assert (code, out) == (1, "")
    assert err == (
        f"outrate top: {server.url} has no outrate metrics: "
        "is the server running with --outrate-policy?\n"
    )


def test_not_a_metrics_page(fake_time: FakeTime) -> None:
    with Server(["<html><body>Grafana</body></html>"]) as server:
        code, _, err = run(server.root, "--once")
    assert code == 1
    assert err == f"outrate top: {server.url} is not a Prometheus metrics page\n"


# --- a hostile server --------------------------------------------------------------------

Answer = Callable[[socket.socket, threading.Event], None]


class Hostile:
    """A raw-socket server on 127.0.0.1 that answers each connection with
    `answer(conn, stop)` in a thread of its own. Every answer ends by itself
    within seconds, and at once when the test leaves the `with` block."""

    def __init__(self, answer: Answer) -> None:
        self.answer, self.stop = answer, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/metrics"
        self.accepter = threading.Thread(target=self._accept, daemon=True)
        self.answers: list[threading.Thread] = []

    def __enter__(self) -> Hostile:
        self.accepter.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.accepter.join(timeout=5)
        for t in self.answers:
            t.join(timeout=5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.answers.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)  # the request
                self.answer(conn, self.stop)
            except OSError:
                pass  # the client hung up: what it should do


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nConnection: close\r\n"
LINES = b'outrate_live_requests{limit="alice"} 1.0\n' * 1600  # 64 KiB of a valid page


def endless(head: bytes, most: int = 2 * MAX_PAGE_BYTES) -> Answer:
    """A valid page that never ends (it stops at `most` bytes, so that a
    client without a cap fails this test instead of the machine)."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(head + b"\r\n")
        sent = 0
        while sent < most and not stop.is_set():
            conn.sendall(LINES)
            sent += len(LINES)

    return answer


def drip(response: bytes, most_s: float = 6.0) -> Answer:
    """`response` a byte a second, for at most `most_s` seconds."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        for i in range(min(len(response), int(most_s))):
            conn.sendall(response[i : i + 1])
            if stop.wait(1.0):
                return

    return answer


def sends(response: bytes) -> Answer:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(response)

    return answer


@pytest.mark.parametrize(
    "head",
    [HEAD, HEAD + b"Content-Length: 1000000000000\r\n", HEAD + b"Transfer-Encoding: chunked\r\n"],
    ids=["until-closed", "content-length-1TB", "chunked"],
)
def test_an_endless_page_stops_at_the_cap(head: bytes) -> None:
    """Memory stays bounded by the cap: the most Python allocated while the
    command ran is measured (tracemalloc), not guessed."""
    chunked = b"chunked" in head
    answer = endless(head) if not chunked else _chunked(head)
    tracemalloc.start()
    try:
        with Hostile(answer) as server:
            code, out, err = run(server.url, "--once")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (code, out) == (1, "")
    assert err == f"outrate top: cannot read {server.url}: response larger than 16 MiB\n"
    print(f"peak Python memory while reading an endless page: {peak / 2**20:.1f} MiB")
    assert peak < 2 * MAX_PAGE_BYTES


def _chunked(head: bytes) -> Answer:
    chunk = b"%x\r\n%s\r\n" % (len(LINES), LINES)

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(head + b"\r\n")
        for _ in range(2 * MAX_PAGE_BYTES // len(LINES)):
            if stop.is_set():
                return
            conn.sendall(chunk)

    return answer


PAGE = BEFORE.page().encode()


@pytest.mark.parametrize(
    "answer",
    [
        drip(HEAD + b"Content-Length: %d\r\n\r\n" % len(PAGE) + PAGE),  # from the status line
        lambda conn, stop: (
            conn.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(PAGE)),
            drip(PAGE)(conn, stop),
        ),
    ],
    ids=["headers", "body"],
)
def test_a_drip_is_cut_off_at_the_timeout(answer: Answer) -> None:
    """--timeout is a deadline for the whole scrape: a byte a second never
    trips a socket timeout of 1 s, yet the command returns in about 1 s."""
    with Hostile(answer) as server:
        t0 = time.monotonic()
        code, out, err = run(server.url, "--once", "--timeout", "1")
        took = time.monotonic() - t0
    assert (code, out) == (1, "")
    assert err == f"outrate top: cannot read {server.url}: timed out\n"
    print(f"a drip cut off after {took:.2f} s (--timeout 1)")
    assert 1.0 <= took < 2.0


@pytest.mark.parametrize(
    ("response", "why"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\xfe" * 50, "not a valid HTTP response (BadStatusLine)"),
        (HEAD + b"X-A: b\r\n" * 101 + b"\r\n", "not a valid HTTP response (HTTPException)"),
        (b"HTTP/1.1 404 \x1b[2J[red]gone" + b"!" * 200 + b"\r\n\r\n", None),
        (HEAD + b"Content-Length: 9000\r\n\r\n" + PAGE[:100], "not a valid HTTP response"),
        (HEAD + b"\r\n" + b"\x00\xff\xfe{{{ ]]] garbage = \n" * 100, "is not a Prometheus"),
    ],
    ids=["not-http", "too-many-headers", "odd-reason", "cut-short", "garbage-body"],
)
def test_garbage_is_one_clear_line(response: bytes, why: str | None) -> None:
    with Hostile(sends(response)) as server:
        code, out, err = run(server.url, "--once", "--timeout", "2")
    assert (code, out) == (1, "")
    assert err.startswith("outrate top: ") and err.count("\n") == 1 and "\x1b" not in err
    if why is None:  # the server's reason phrase, shortened and made printable
        assert (
            err == f"outrate top: cannot read {server.url}: HTTP 404 ?[2J[red]gone{'!' * 67}...\n"
        )
    elif why.startswith("not"):
        assert err.startswith(f"outrate top: cannot read {server.url}: {why}")
    else:
        assert err == f"outrate top: {server.url} {why} metrics page\n"


EVIL = "x\x1b[2J\u202e"  # an escape sequence that clears the screen, a bidi override
MARKUP = replace(
    BEFORE,
    tokens={"[/]": 10, "[bold]x": 20, EVIL: 0},
    held={"[/]": 1, "[bold]x": 0, EVIL: 0},
    live={"[/]": 2, "[bold]x": 1, EVIL: 0},
    throttled={"[/]": 0.0, "[bold]x": 0.0, EVIL: 0.0},
    limits={"[/]": (20.0, "enforce"), "[bold]x": (5.0, "[i]shadow"), EVIL: (1.0, "enforce")},
    shadow_over={},
    borrowed={},
    peaks={"[/]": 40.0, "[bold]x": 5.0, EVIL: 1.0},
    prompt={},  # no prompt series: `-`
    prompt_limits={},
    prompt_waiting={},
)


def test_user_ids_are_data_not_markup(fake_time: FakeTime) -> None:
    """`metrics: {per_user: ["*"]}` puts any id on the page: `[/]` crashed
    rich's markup parser, `[bold]x` printed as a bold `x`; and a label may
    carry what a terminal obeys."""
    later = replace(MARKUP, tokens={"[/]": 30, "[bold]x": 24, EVIL: 0})
    with Server([MARKUP.page(), later.page()]) as server:
        code, out, err = run(server.root, "--once", "--interval", "2")
    assert (code, err) == (0, "")
    assert [" ".join(line.split()) for line in out.splitlines()[3:]] == [
        "[/] 10.0 0.0 20 40 enforce 1 2 0% - - - - - -",
        "[bold]x 2.0 0.0 5 5 [i]shadow 0 1 0% - - - - - -",
        "x\\x1b[2J\\u202e 0.0 0.0 1 1 enforce 0 0 - - - - - - -",
    ]
    assert "\x1b" not in out and "\u202e" not in out


NAN = float("nan")
NON_FINITE = replace(
    BEFORE,
    tokens={"alice": INF, "bob": NAN, "carol": 5},
    held={"alice": INF, "bob": NAN, "carol": -INF},
    live={"alice": INF, "bob": NAN, "carol": 1},
    throttled={"alice": 1.0, "bob": NAN, "carol": INF},
    limits={"alice": (NAN, "enforce"), "bob": (-INF, "enforce"), "carol": (INF, "shadow")},
    shadow_over={"carol": NAN},
    borrowed={"alice": INF, "bob": NAN, "carol": -INF},
    peaks={"alice": NAN, "bob": -INF, "carol": INF},
    prompt={"alice": INF, "bob": NAN, "carol": 5},
    prompt_limits={"alice": NAN, "bob": -INF, "carol": INF},
    prompt_waiting={"alice": INF, "bob": NAN, "carol": -INF},
    displaced=INF,
    deferred={"budget": NAN},
)


def test_non_finite_values_print_as_such(fake_time: FakeTime) -> None:
    """+Inf in a gauge crashed `round()`; every figure may be inf, -inf or nan."""
    page = NON_FINITE.page()
    assert 'outrate_held_requests{limit="alice"} +Inf' in page
    assert 'outrate_held_requests{limit="bob"} NaN' in page
    with Server([page, page]) as server:
        code, out, err = run(server.root, "--once", "--interval", "2")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[1].endswith("displaced: inf; deferred: budget nan")
    assert sorted(" ".join(line.split()) for line in lines[3:]) == [
        "alice nan nan nan nan enforce inf inf 0% - nan nan inf - -",
        "bob nan nan -inf -inf enforce nan nan nan - nan -inf nan - -",
        # -inf less -inf
        "carol 0.0 nan unlimited unlimited shadow -inf 1 nan nan 0.0 unlimited -inf - -",
    ]


@pytest.mark.parametrize(
    "args",
    [
        [],  # no URL
        ["http://h:1", "--interval", "0"],
        ["http://h:1", "--interval", "soon"],
        ["http://h:1", "--onse"],
        ["ftp://h:1"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    code, out, _ = run(*args)
    assert (code, out) == (2, "")


def test_top_never_imports_vllm() -> None:
    """`outrate top` runs on an operator's laptop, where vLLM is not installed."""
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "import outrate.cli\n"
        "r = CliRunner().invoke(outrate.cli.app, ['top', sys.argv[1], '--once', "
        "'--interval', '0.05'])\n"
        "assert r.exit_code == 0, r.output\n"
        "heavy = {m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}\n"
        "assert not heavy, heavy\n"
    )
    with Server([BEFORE.page(), AFTER.page()]) as server:
        subprocess.run([sys.executable, "-c", script, server.root], check=True, cwd=ROOT)


def _plain(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=top.UNWRAPPED)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]
