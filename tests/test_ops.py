"""The dashboard and the alerts work (ops/): the Grafana dashboard is
well-formed JSON for Grafana's import, the Prometheus rules pass `promtool
check rules` and their unit tests, every alert has a runbook, and, end to
end, a real Prometheus scraping a real `outrate serve` runs every expression
of the dashboard, the rules and the README and finds the series they name,
while `outrate top` reads the same figures as the dashboard's queries.

One module, one server (with a real redis-server as its budget store, so the
store's series exist), one Prometheus, ~25 s of traffic."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_support import (
    binaries,
    metric_names,
    page_series,
    promtool_expect,
    value,
    without_prometheus,
)

from outrate.budget.quota import QuotaBook
from outrate.budget.shared.metrics import StoreMetrics
from outrate.observe.metrics import Metrics
from outrate.observe.publish import families, snapshot
from outrate.observe.quotas import quota_usage
from outrate.policy.compiler import compile_policy
from outrate.policy.loader import parse_policy
from vllm_integration.apiserver.metrics import API_SERVER_COUNTERS, REFUSED

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "ops" / "grafana" / "outrate.json"
RULES = REPO / "ops" / "prometheus" / "outrate-rules.yml"
RULE_TESTS = REPO / "ops" / "prometheus" / "outrate-rules.test.yml"
RUNBOOK = REPO / "docs" / "alerts.md"
README = REPO / "README.md"

GRAFANA_VARS = {"$__rate_interval": "1m", "$instance": ".*", "$limit": ".*"}
"""What the e2e test puts for the dashboard's variables: every engine and
limit (the variables' allValue), and a window that holds the traffic."""


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_exprs(substitute: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every query, variables substituted."""
    out = []
    for p in panels(dashboard()):
        for t in p.get("targets", []):
            expr = t["expr"]
            for var, val in (substitute or {}).items():
                expr = expr.replace(var, val)
            out.append((f"{p['title']} / {t['refId']}", expr))
    return out


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def readme_exprs() -> list[tuple[str, str]]:
    """Every expression of the README's ```promql blocks: a block holds
    expressions separated by `# comment` lines (one may span lines)."""
    out = []
    for block in re.findall(r"```promql\n(.*?)```", README.read_text(), re.S):
        current: list[str] = []
        title = "README"
        for line in [*block.splitlines(), "#"]:
            if line.lstrip().startswith("#"):
                if current:
                    out.append((title, " ".join(current)))
                current, title = [], "README: " + line.lstrip("# ").strip()
            elif line.strip():
                current.append(line.strip())
    return out


def rendered(data: dict[str, Any]) -> str:
    """The /metrics text outrate's collector makes of one snapshot."""
    registry = CollectorRegistry()

    class Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            return families(data)

    registry.register(Collector())
    return generate_latest(registry).decode()


def exported_names() -> set[str]:
    """Every sample name outrate renders, from a snapshot that has every part
    (a limit, the store, the trace, quota usage), and the API server's own
    counters: what /metrics can show."""
    pol = compile_policy(
        parse_policy("version: 1\ndefault: {rate: 10, quota: {output: 1K/day}}\n", "t.yaml"),
        "t.yaml",
        "sha",
    )
    store = StoreMetrics()
    store.primaries = ["127.0.0.1:6379"]  # known after the first round trip
    quota = quota_usage(QuotaBook(), Metrics(), pol)
    text = rendered(snapshot(Metrics(), pol, store=store.snapshot(), trace_dropped=0, quota=quota))
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    return names | {f"{name}_total" for name, _ in API_SERVER_COUNTERS}


# -- the dashboard, statically -----------------------------------------------------


def test_dashboard_is_an_importable_grafana_dashboard():
    """What Grafana's import needs and what makes this one portable: a
    dashboard model (title, uid, schemaVersion), every panel and query on
    the `datasource` variable, unique panel ids, grid positions inside the
    24 columns that do not overlap, a query with an expr and a unique refId
    in every non-row panel, and the `datasource`, `instance` and `limit`
    variables (`limit` from label_values over the configured limits)."""
    dash = dashboard()
    assert dash["title"] and dash["uid"] == "outrate"
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert "__inputs" not in dash  # nothing to map at import: the variable picks the source
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    limit = variables["limit"]
    assert limit["type"] == "query"
    assert limit["query"]["query"] == "label_values(outrate_limit_tokens_per_second, limit)"
    assert limit["definition"] == limit["query"]["query"]
    assert limit["multi"] and limit["includeAll"] and limit["allValue"] == ".*"
    assert variables["instance"]["query"]["query"] == "label_values(outrate_policy_info, instance)"
    for v in (limit, variables["instance"]):
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}

    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), ids
    cells: set[tuple[int, int]] = set()
    for p in panels(dash):
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat", "table"), p["type"]
        assert p["title"] and p["description"], p["id"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
            assert "$datasource" not in t["expr"]


def test_dashboard_covers_what_the_issue_asks():
    """The figures an operator needs, each on some panel (by the metric it reads)."""
    used = set().union(*(metric_names(e) for _, e in dashboard_exprs(GRAFANA_VARS)))
    for name in (
        "outrate_output_tokens_total",
        "outrate_limit_tokens_per_second",
        "outrate_limit_peak_tokens_per_second",
        "outrate_borrowed_tokens_total",
        "outrate_lent_total",
        "outrate_reclaimed_total",
        "outrate_throttled_seconds_total",
        "outrate_held_requests",
        "outrate_live_requests",
        "outrate_token_interval_seconds_bucket",
        "outrate_budget_wait_seconds_bucket",
        "outrate_shadow_over_limit_tokens_total",
        "outrate_prompt_tokens_total",
        "outrate_limit_prompt_tokens_per_second",
        "outrate_prompt_waiting_requests",
        "outrate_prompt_waits_total",
        "outrate_prompt_shadow_over_tokens_total",
        "outrate_policy_reloads_total",
        "outrate_policy_info",
        "outrate_store_up",
        "outrate_lease_seconds_bucket",
        "outrate_store_errors_total",
        "outrate_store_engines",
        "outrate_store_policy_mismatch",
        "outrate_store_waiting",
        "outrate_store_engines_missing",
        "outrate_store_primary",
        "outrate_store_failovers_total",
        "outrate_store_redirects_total",
        "outrate_store_resets_total",
        "outrate_requests_refused_total",
        "outrate_quota_used_tokens",
        "outrate_quota_tokens",
        "outrate_quota_spent_users",
        "vllm:num_requests_running",
    ):
        assert name in used, name
    assert any(
        "histogram_quantile(0.99" in e and "outrate_token_interval_seconds_bucket" in e
        for _, e in dashboard_exprs()
    )
    policy_panels = [t for t, e in dashboard_exprs() if "sha256" in e and "instance" in e]
    assert policy_panels, "no panel shows the policy's sha256 per instance"


def test_every_outrate_name_in_dashboard_rules_and_readme_is_exported():
    """Without Prometheus or vLLM: a metric renamed in outrate's code (or a
    typo in ops/) fails here, in `make test-fast` too. The e2e test below
    checks every name, vLLM's too, against a real scrape."""
    exported = exported_names()
    exprs = [*dashboard_exprs(GRAFANA_VARS), *readme_exprs()]
    exprs += [(r.get("record") or r["alert"], r["expr"]) for r in rules()]
    missing = {
        (where, name)
        for where, expr in exprs
        for name in metric_names(expr)
        if name.startswith("outrate_") and name not in exported
    }
    assert not missing, sorted(missing)
    for where, expr in exprs:
        for name in metric_names(expr):
            if ":" in name and not name.startswith("vllm:"):
                assert name in recorded(), (where, name)


# -- the rules, statically ----------------------------------------------------------


def test_every_alert_has_a_summary_and_a_runbook_section():
    doc = RUNBOOK.read_text()
    headings = {h.strip().lower() for h in re.findall(r"^## (.+)$", doc, re.M)}
    readme = README.read_text()
    for rule in alerts():
        name = rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"].strip(), name
        assert annotations["runbook_url"] == f"docs/alerts.md#{name.lower()}", name
        assert name.lower() in headings, f"docs/alerts.md has no section {name}"
        section = doc.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "**Runbook:**" in section, name
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), name
        assert f"[{name}](docs/alerts.md#{name.lower()})" in readme, f"README lacks {name}"


def test_every_alert_is_unit_tested_firing_and_quiet():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for rule in alerts():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: never expected to fire"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no quiet case"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = binaries()
    if found is None:
        without_prometheus()
    return found[1]


def test_promtool_checks_the_rules(promtool):
    check = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules())} rules found" in check.stdout


def test_promtool_unit_tests_of_the_rules_pass(promtool):
    run = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def _series(name: str, limit: str, values: str, **labels: str) -> dict[str, str]:
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return {
        "series": f'{name}{{job="vllm", instance="e:8000", limit="{limit}"{extra}}}',
        "values": values,
    }


PROMPT_SERIES = [
    _series("outrate_prompt_tokens_total", "mallory", "0+7500x12"),
    _series("outrate_prompt_tokens_total", "bob", "0+1500x12"),
    _series("outrate_limit_prompt_tokens_per_second", "mallory", "500x12", mode="enforce"),
    _series(
        "outrate_limit_prompt_tokens_per_second", "bob", " ".join(["Inf"] * 13), mode="enforce"
    ),
    _series("outrate_prompt_waiting_requests", "mallory", "3x12"),
    _series("outrate_prompt_waiting_requests", "bob", "0x12"),
    _series("outrate_prompt_waits_total", "mallory", "0+30x12"),
    _series("outrate_prompt_waits_total", "bob", "0x12"),
    _series("outrate_prompt_shadow_over_tokens_total", "peek", "0+300x12"),
]
"""Prompt series in 15 s samples: mallory computes 500
prompt tok/s at her 500 tok/s prompt limit with 3 requests waiting and 2 waits
starting a second; bob 100 tok/s, prompts unlimited; peek, a shadow rule, 20
tok/s over its prompt limit."""

PROMPT_PANELS: dict[str, dict[str, float]] = {
    "Prompt tokens/s against the prompt limit / A": {"mallory": 500, "bob": 100},
    "Prompt tokens/s against the prompt limit / B": {"mallory": 500},  # bob: no prompt limit
    "Waiting for prompt budget, per limit / A": {"mallory": 3, "bob": 0},
    "Waiting for prompt budget, per limit / B": {"mallory": 2, "bob": 0},
    "Shadow: prompt tokens/s a shadow prompt limit would hold back / A": {"peek": 20},
}
"""What each dashboard query over the prompt series returns on PROMPT_SERIES,
per limit. The e2e run below cannot show them with data: its server shares
budgets through a store, and its policy sets no prompt limit."""


def prompt_exprs() -> dict[str, str]:
    return {
        where: expr
        for where, expr in dashboard_exprs(GRAFANA_VARS)
        if any("prompt" in name for name in metric_names(expr))
    }


def test_the_prompt_panels_show_what_the_prompt_series_say(promtool, tmp_path):
    """Every dashboard query over a prompt series, evaluated by promtool (the
    PromQL engine of Prometheus) on synthetic series of a prompt-limited
    user, an unlimited one and a shadow one: each returns its figures per
    limit, and a limit without a prompt rate has no limit line."""
    exprs = prompt_exprs()
    assert set(exprs) == set(PROMPT_PANELS)
    cases = [
        {
            "expr": exprs[where],
            "eval_time": "2m",
            "exp_samples": [
                {"labels": f'{{limit="{limit}"}}', "value": value}
                for limit, value in sorted(want.items())
            ],
        }
        for where, want in PROMPT_PANELS.items()
    ]
    spec = {
        "tests": [
            {
                "interval": "15s",
                "input_series": PROMPT_SERIES,
                "promql_expr_test": cases,
            }
        ]
    }
    path = tmp_path / "prompt-panels.test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    run = subprocess.run(
        [promtool, "test", "rules", path.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


QUOTA_NAMES = {"outrate_quota_used_tokens", "outrate_quota_tokens", "outrate_quota_spent_users"}
CONTRACT_NAMES = QUOTA_NAMES | {"outrate_requests_refused_total"}


def contract_exprs() -> dict[str, str]:
    """The dashboard's queries over refusals and quota usage."""
    return {
        where: expr
        for where, expr in dashboard_exprs(GRAFANA_VARS)
        if metric_names(expr) & CONTRACT_NAMES
    }


def contract_series() -> list[dict[str, str]]:
    """What the exporters themselves write, as promtool input: the engine's
    quota gauges rendered from a real quota book (alice, listed, over her
    1,000 a day; carol and dave under the default's 500 an hour, carol over
    it) and the API server's refusal counter (prometheus_client's, as
    count_requests_over makes it): flood 30 and alice 15 refusals per 15 s."""
    from prometheus_client import Counter

    pol = compile_policy(
        parse_policy(
            "version: 1\ndefault: {rate: 10, quota: {output: 500/hour}}\n"
            "users:\n  alice: {rate: 10, quota: {output: 1K/day}}\n  flood: {rate: 10}\n",
            "t.yaml",
        ),
        "t.yaml",
        "sha",
    )
    book = QuotaBook()
    for user, tokens in (("alice", 1200), ("carol", 600), ("dave", 100)):
        book.add(user, "output", tokens, [q.window for q in pol.limit_for(user).quotas])
    metrics = Metrics()
    text = rendered(snapshot(metrics, pol, quota=quota_usage(book, metrics, pol)))
    registry = CollectorRegistry()
    refused = Counter(*REFUSED, ["limit", "reason"], registry=registry)
    refused.labels("flood", "requests").inc(30)
    refused.labels("alice", "quota").inc(15)
    text += generate_latest(registry).decode()
    counters = {f"{REFUSED[0]}_total"}
    return page_series(text, CONTRACT_NAMES, counters)


CONTRACT_PANELS: dict[str, list[tuple[dict[str, str], float]]] = {
    "Requests refused with 429, per limit and reason (per s) / A": [
        ({"limit": "alice", "reason": "quota"}, 1),
        ({"limit": "flood", "reason": "requests"}, 2),
    ],
    "Quota used against the quota, per limit and window / A": [
        ({"limit": "alice", "kind": "output", "window": "day"}, 1200),
        ({"limit": "anonymous", "kind": "output", "window": "hour"}, 0),  # the default's quota
        ({"limit": "default", "kind": "output", "window": "hour"}, 700),
    ],
    "Quota used against the quota, per limit and window / B": [
        ({"limit": "alice", "kind": "output", "window": "day"}, 1000),
        ({"limit": "anonymous", "kind": "output", "window": "hour"}, 500),
        ({"limit": "default", "kind": "output", "window": "hour"}, 500),
    ],
    "Users out of quota, per limit and window / A": [
        ({"limit": "alice", "kind": "output", "window": "day"}, 1),
        ({"limit": "anonymous", "kind": "output", "window": "hour"}, 0),
        ({"limit": "default", "kind": "output", "window": "hour"}, 1),
    ],
}


def test_the_refusal_and_quota_panels_show_what_the_exporters_write(promtool, tmp_path):
    """Each dashboard query over refusals and quota usage, evaluated by
    promtool on the series outrate's exporters render: it returns each
    limit's figures. (The e2e run below shares budgets through a store,
    which refuses quotas (OR122): test_e2e_quota runs the same queries on
    the session server's own page.)"""
    exprs = contract_exprs()
    assert set(exprs) == set(CONTRACT_PANELS)
    cases = [
        {
            "expr": exprs[where],
            "exp_samples": [
                {"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}",
                 "value": v}
                for labels, v in want
            ],
        }
        for where, want in CONTRACT_PANELS.items()
    ]  # fmt: skip
    promtool_expect(promtool, tmp_path, contract_series(), cases)


# -- end to end: a real Prometheus scraping a real `outrate serve` ---------------

POLICY = """\
version: 1
default: unlimited
burst: 100ms
users:
  alice: {rate}
  peek: {{rate: 20, shadow: true}}
  lender: {{rate: {lender}, peak: {peak}}}
  spare: {spare}
  hasty: {{rate: unlimited, requests: 1/min}}
"""
RATE = 20  # alice's: 2 streams of 270 tokens, 27 s
LENDER, PEAK = 5, 15  # lender's committed rate and peak: one stream borrows the rest
TOP_INTERVAL_S = 15.0
"""The window `outrate top --once --interval 15` and the dashboard's queries share."""


class Run:
    """What one run of traffic left for the tests to check."""

    def __init__(self, prom: Any, server: Any) -> None:
        self.prom = prom
        self.server = server
        self.top_rows: dict[str, Any] = {}
        self.top_window: tuple[float, float] = (0.0, 0.0)
        self.end = 0.0
        self.refused = 0
        self.report: list[str] = []


def _loop(api: Any, user: str, tokens: int, stop: threading.Event, out: list) -> None:
    from loadgen import stream_completion

    while not stop.is_set():
        out.append(stream_completion(api, user, tokens))


def _hasty(api: Any) -> int:
    """Three requests of `hasty` (1 a minute) at once: how many got 429."""
    import openai

    refused = 0
    for _ in range(3):
        try:
            api.completions.create(
                model="tiny",
                prompt="hi",
                max_tokens=1,
                extra_body={"vllm_xargs": {"output_rate_user": "hasty"}},
            )
        except openai.RateLimitError:
            refused += 1
    return refused


def _policy(spare: int) -> str:
    return POLICY.format(rate=RATE, lender=LENDER, peak=PEAK, spare=spare)


def _write(path: Path, text: str) -> None:
    """Atomically, as an editor saving the file would: the reloader never
    reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _wait_reloads(url: str, result: str, n: int, timeout_s: float = 10) -> None:
    from outrate.observe.top import scrape

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reloads = scrape(url, 5).reloads or {}
        if reloads.get(result, 0) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {result} reload #{n} within {timeout_s} s")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Redis, `outrate serve` (store, trace, a policy with a limited, an
    unlimited, a shadow and a borrowing user) and Prometheus scraping it
    every second with the rules loaded; then traffic: alice (20 tok/s, 2
    streams, 27 s), `free` (unlimited), `peek` (shadow 20 tok/s) and
    `lender` (5 tok/s, peak 15) streaming back to back,
    one good and one bad edit of the policy file, and `outrate top`'s two
    scrapes, 15 s apart, in the middle. Logs: the module's tmp dir, `ops0/`."""
    if binaries() is None:
        without_prometheus()
    pytest.importorskip("vllm")
    pytest.importorskip("redis")
    from build_tiny_model import build
    from loadgen import client, stream_completion
    from prometheus_support import PrometheusServer
    from redis_support import RedisServer
    from serverproc import ServerProcess, outrate_serve_argv

    from outrate.observe import top

    began = time.monotonic()
    tmp = tmp_path_factory.mktemp("ops")
    policy = tmp / "policy.yaml"
    policy.write_text(_policy(spare=5))
    model = build(REPO / "models" / "tiny-llama")
    redis = RedisServer(tmp / "redis")
    trace = str(tmp / "trace.jsonl")
    argv = outrate_serve_argv(model, policy, "--outrate-store", redis.url, "--outrate-trace", trace)
    server = ServerProcess(argv, log_path=tmp / "server.log", name="ops")
    prom = PrometheusServer(tmp / "prometheus", [f"127.0.0.1:{server.port}"], [RULES])
    stop = threading.Event()  # ends the back-to-back streams
    try:
        redis.start()
        prom.start()
        server.start(timeout_s=300)
        result = Run(prom, server)
        result.report.append(f"server ready in {server.startup_s:.1f} s")
        assert prom.wait_for('up{job="vllm"} == 1'), "Prometheus never scraped the server"
        api = client(server.base_url)
        streams: list = []
        threads = [
            threading.Thread(
                target=lambda: streams.append(stream_completion(api, "alice", 270)), daemon=True
            )
            for _ in range(2)
        ]
        threads += [
            threading.Thread(target=_loop, args=(api, user, 64, stop, streams), daemon=True)
            for user in ("free", "peek", "lender")
        ]
        traffic = time.monotonic()
        for t in threads:
            t.start()
        metrics = server.root_url + "/metrics"
        result.refused = _hasty(api)  # 1 a minute: the second and third get 429
        _write(policy, _policy(spare=6))  # a good edit
        _wait_reloads(metrics, "applied", 1)
        _write(policy, _policy(spare=-1))  # refused: the last good one serves
        _wait_reloads(metrics, "rejected", 1)
        time.sleep(max(0.0, traffic + 5 - time.monotonic()))  # alice's streams in steady state
        first = top.scrape(metrics, 5, clock=time.time)
        time.sleep(TOP_INTERVAL_S)
        second = top.scrape(metrics, 5, clock=time.time)
        result.top_window = (first.at, second.at)
        result.top_rows = {r.limit: r for r in top.rows(first, second)}
        for t in threads[:2]:
            t.join(timeout=120)
        stop.set()
        for t in threads[2:]:
            t.join(timeout=60)
        for s in streams:
            assert s.error is None, s.error
        time.sleep(3)  # the last snapshot (0.5 s), scrapes and rule evaluations (1 s)
        result.end = time.time()
        result.report.append(
            f"traffic {time.monotonic() - traffic:.1f} s, {len(streams)} streams; "
            f"setup and traffic {time.monotonic() - began:.1f} s"
        )
        yield result
    finally:
        stop.set()
        server.stop()
        prom.stop()
        redis.stop()


def all_exprs() -> list[tuple[str, str, bool]]:
    """(where, expr, must return samples) of every expression in ops/ and the
    README. Alert conditions are empty by design while nothing is wrong: they
    must parse and every series they name must exist; everything else must
    return samples where traffic was, but the prompt limit's line and the
    quota panels: the run's policy sets no prompt limit and no quota, so no
    limit has a finite prompt rate and there is no quota usage
    (test_the_prompt_panels_show_what_the_prompt_series_say and
    test_the_refusal_and_quota_panels_show_what_the_exporters_write check
    them with data, test_e2e_quota on a real page)."""
    not_here = {"Prompt tokens/s against the prompt limit / B", *contract_exprs()}
    not_here -= {w for w, e in contract_exprs().items() if not metric_names(e) & QUOTA_NAMES}
    out = [(w, e, w not in not_here) for w, e in dashboard_exprs(GRAFANA_VARS)]
    out += [(w, e, True) for w, e in readme_exprs()]
    out += [(r["record"], r["expr"], True) for r in rules() if "record" in r]
    out += [(r["alert"], r["expr"], False) for r in alerts()]
    return out


@pytest.mark.e2e
@pytest.mark.beside  # top and the dashboard read the same counters; alerts' for: outlasts it
def test_prometheus_runs_every_expression_on_the_real_series(run):
    prom = run.prom
    names = prom.names()
    empty, missing = [], []
    for where, expr, wanted in all_exprs():
        for name in sorted(metric_names(expr) - names - QUOTA_NAMES):  # none here: OR122
            missing.append(f"{where}: {name}")
        samples = prom.query(expr, at=run.end)  # raises with Prometheus's parse error
        if wanted and not samples:
            empty.append(f"{where}: {expr}")
    assert not missing, "series not scraped (renamed?):\n" + "\n".join(missing)
    assert not empty, "no samples:\n" + "\n".join(empty)
    assert recorded() <= names
    assert run.refused == 2  # hasty's: the refusal panel's data
    print(f"{len(all_exprs())} expressions, {len(names)} metric names", *run.report, sep="\n")


@pytest.mark.e2e
@pytest.mark.beside  # top and the dashboard read the same counters; alerts' for: outlasts it
def test_the_dashboard_variables_find_their_values(run):
    """label_values(outrate_limit_tokens_per_second, limit) and
    label_values(outrate_policy_info, instance), as Grafana asks them."""
    limits = run.prom.api("label/limit/values", **{"match[]": "outrate_limit_tokens_per_second"})
    assert {"alice", "peek", "default", "anonymous"} <= set(limits)
    instances = run.prom.api("label/instance/values", **{"match[]": "outrate_policy_info"})
    assert instances == [f"127.0.0.1:{run.server.port}"]


@pytest.mark.e2e
@pytest.mark.beside  # top and the dashboard read the same counters; alerts' for: outlasts it
def test_rules_evaluate_and_the_alerts_tell_the_truth(run):
    """Every rule evaluates without error on the real series. The edit that
    was refused fires OutratePolicyReloadRejected; peek's shadow rule, over
    its rate all along, makes OutrateShadowWouldRefuse pending (its `for:` is
    15 minutes); nothing else is wrong here, so nothing else is active (but
    OutrateLeaseSlow may be pending, and OutrateLimitMostlyHeld could be; and
    OutrateStoreErrors is pending if a starved round trip timed out)."""
    states, evaluated = {}, {}
    for group in run.prom.api("rules")["groups"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
            if rule["type"] == "alerting":
                states[rule["name"]] = rule["state"]
                evaluated[rule["name"]] = rule["lastEvaluation"]
    assert set(states) == {r["alert"] for r in alerts()}
    assert states.pop("OutratePolicyReloadRejected") == "firing"
    assert states.pop("OutrateShadowWouldRefuse") == "pending"
    # alice is held ~95% of the time, but a 5-minute rate over 25 s of traffic is not 80%
    assert states.pop("OutrateLimitMostlyHeld") != "firing"
    # a loaded 2-core machine may stall a round trip now and then: pending at most
    lease = run.prom.query("instance:outrate_lease_seconds:p99_5m", at=run.end)
    print(f"lease round trip p99 {value(lease[0]) * 1000:.1f} ms")
    assert states.pop("OutrateLeaseSlow") != "firing"
    # ... or past its 0.5 s timeout: a failed round trip, retried at the next
    # round (faults.DOWN_AFTER), so the store stays up and the alert, whose
    # `for:` is 10 minutes, is pending exactly while the counter shows it
    at = datetime.fromisoformat(evaluated["OutrateStoreErrors"]).timestamp()
    errors = value(run.prom.query("sum(increase(outrate_store_errors_total[10m]))", at=at)[0])
    up = value(run.prom.query("min_over_time(outrate_store_up[5m])", at=run.end)[0])
    print(f"store round trips failed: {errors:.1f} (extrapolated); up all along: {up == 1}")
    assert up == 1
    assert states.pop("OutrateStoreErrors") == ("pending" if errors > 0 else "inactive")
    assert set(states.values()) == {"inactive"}, states


def _panel_expr(title: str, ref: str, window: str, limit: str) -> str:
    subst = {"$__rate_interval": window, "$instance": ".*", "$limit": limit}
    for where, expr in dashboard_exprs(subst):
        if where == f"{title} / {ref}":
            return expr
    raise KeyError(title)


@pytest.mark.e2e
@pytest.mark.beside  # top and the dashboard read the same counters; alerts' for: outlasts it
def test_outrate_top_agrees_with_the_dashboard_over_the_same_interval(run):
    """`outrate top`'s figures (its scrape and rows: what `--once` prints)
    against the dashboard's own queries with `$__rate_interval` set to top's
    interval, evaluated at top's second scrape: alice's rate, throttled share
    and requests, the unlimited `default` and the shadow rule's rates, and
    what `lender` borrowed over its rate, up to its peak, from the engine's
    spare capacity.

    Within 15% (+0.5 tok/s), not to the digit: a counter on /metrics is up to
    1 s behind the engine (a checkpoint every 0.5 s, a snapshot every 0.5 s),
    so top's reading and Prometheus's sample (up to 1 s older, extrapolated
    by rate()) at each end of the window may differ by 1 s of tokens: at most
    2 s in 15 (13%). Gauges and the configured rate agree exactly."""
    prom = run.prom
    t0, t1 = run.top_window
    window = f"{round((t1 - t0) * 1000)}ms"
    rows = run.top_rows

    def dash(title: str, ref: str, limit: str) -> float:
        samples = prom.query(_panel_expr(title, ref, window, limit), at=t1)
        assert len(samples) == 1, (title, limit, samples)
        return value(samples[0])

    def close(a: float | None, b: float, rel: float = 0.15, abs_: float = 0.5) -> bool:
        return a is not None and abs(a - b) <= rel * abs(b) + abs_

    rate = "Output rate against the configured limit (tok/s)"
    requests = "Requests held and live, per limit"
    got = {limit: dash(rate, "A", limit) for limit in ("alice", "default", "peek", "lender")}
    shadow = dash("Shadow: tokens/s a shadow rule would refuse", "A", "peek")
    throttled = dash("Throttled share (live request-time spent held)", "A", "alice")
    live, held = dash(requests, "B", "alice"), dash(requests, "A", "alice")
    borrowed = dash("Borrowed from spare capacity (tok/s)", "A", "lender")
    alice, lender = rows["alice"], rows["lender"]
    lines = [f"{k}: top {rows[k].rate:.1f} tok/s, dashboard {v:.1f}" for k, v in got.items()]
    lines.append(f"peek shadow over: top {rows['peek'].shadow_over:.1f}, dashboard {shadow:.1f}")
    lines.append(f"alice throttled: top {alice.throttled:.1%}, dashboard {throttled:.1%}")
    lines.append(f"alice held/live: top {alice.held}/{alice.live}, dashboard {held:g}/{live:g}")
    lines.append(f"lender borrowed: top {lender.borrowed:.1f} tok/s, dashboard {borrowed:.1f}")
    print(f"over {t1 - t0:.2f} s:", *lines, sep="\n")
    for limit, v in got.items():
        assert close(rows[limit].rate, v), lines
    assert close(rows["peek"].shadow_over, shadow), lines
    assert close(alice.throttled, throttled, abs_=0), lines
    assert alice.throttled is not None and alice.throttled > 0.8  # 2 streams at 20 tok/s
    assert alice.live == live == 2 and 0 <= held <= 2 and alice.held is not None
    assert rows["default"].rate is not None and rows["default"].rate > 2 * RATE  # unthrottled
    assert dash(rate, "B", "alice") == alice.rate_limit == RATE
    assert close(lender.borrowed, borrowed), lines
    # alone with spare capacity, lender runs near its peak, the part over its rate borrowed
    assert lender.rate is not None and lender.rate > LENDER + 0.5 * (PEAK - LENDER), lines
    assert borrowed > 0.5 * (PEAK - LENDER), lines
    assert dash(rate, "C", "lender") == lender.peak == PEAK
    assert alice.peak == RATE and rows["default"].peak == float("inf")  # no peak: the rate
