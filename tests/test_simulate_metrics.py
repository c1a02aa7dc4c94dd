"""`simulate calibrate --metrics`: the step model fitted to vLLM's own
counters (outrate.simulate.counters, outrate.simulate.metricsfit).

The pages are what prometheus_client prints for metrics named and labelled
as vLLM 0.32's (`FakeEngine`: steps of a known model on a fake clock, the
counters observed as vLLM observes them), one real page recorded from
`outrate serve` on the tiny model (tests/fixtures/simulate/vllm-metrics.txt),
and a fake Prometheus answering range queries over the fake engine's
scrapes. Nothing sleeps: the scrape loop gets the fake clock."""

from __future__ import annotations

import json
import math
import random
import re
import urllib.parse
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from outrate.cli import app
from outrate.errors import OutrateError
from outrate.simulate import counters
from outrate.simulate.counters import parse_page, read_metrics, read_prometheus, scrape_engine
from outrate.simulate.metricsfit import calibrate_metrics
from outrate.simulate.stepmodel import StepModel, load_step_model

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "simulate"
TRUTH = StepModel(fixed_us=3000, per_decode_us=250, per_prefill_us=15)
URL = "http://engine:8000/metrics"
PROM = "http://prometheus:9090"
runner = CliRunner()


class FakeEngine:
    """Steps of `model` on a fake clock, counted as vLLM counts them: a step
    with output observes its computed prompt tokens plus generated ones in
    vllm:iteration_tokens_total, a token after a request's first one an
    inter-token latency, and the running gauge is the last step's batch.
    The decode batch and the arrivals drift (two periods), so intervals
    differ; `idle` spans have no steps and nothing running; without
    `arrivals`, no request starts (no prompt tokens)."""

    def __init__(
        self,
        model: StepModel,
        seed: int = 1,
        idle: tuple[tuple[float, float], ...] = (),
        arrivals: bool = True,
    ) -> None:
        self.model, self.rng, self.idle = model, random.Random(seed), idle
        self.arrivals = arrivals
        self.registry = CollectorRegistry()
        labels = ("model_name", "engine")

        def metric(cls, name, **kw):
            return cls(name, name, labels, registry=self.registry, **kw).labels("tiny", "0")

        self.iteration = metric(
            Histogram, "vllm:iteration_tokens_total", buckets=(1, 8, 16, 32, 64, 128, 256, 512)
        )
        self.itl = metric(Histogram, "vllm:inter_token_latency_seconds")
        self.generation = metric(Counter, "vllm:generation_tokens")
        self.prompt = metric(Counter, "vllm:prompt_tokens")
        self.running = metric(Gauge, "vllm:num_requests_running")
        self.running.set(5)  # already serving when the first reading is taken
        self.now_ns = 0

    def _idle_at(self, t_ns: int) -> float | None:
        """The end of the idle span `t_ns` is in (seconds), or None."""
        t = t_ns / 1e9
        return next((end for start, end in self.idle if start <= t < end), None)

    def run_until(self, t_ns: int) -> None:
        while self.now_ns < t_ns:
            idle_end = self._idle_at(self.now_ns)
            if idle_end is not None:
                self.running.set(0)
                self.now_ns = max(self.now_ns + 1, int(idle_end * 1e9))
                continue
            t = self.now_ns / 1e9
            decode = max(1, round(5 + 4 * math.sin(t / 3) + self.rng.uniform(-1, 1)))
            chance = 0.15 + 0.12 * math.sin(t / 7.3) if self.arrivals else 0.0
            new = 1 if self.rng.random() < chance else 0
            prompt = new * self.rng.randint(50, 400)
            step_ns = self.model.step_ns(decode, prompt)
            self.iteration.observe(prompt + decode + new)
            self.generation.inc(decode + new)
            self.prompt.inc(prompt)
            for _ in range(decode):
                self.itl.observe(step_ns / 1e9)
            self.running.set(decode + new)
            self.now_ns += step_ns

    def page(self) -> str:
        return generate_latest(self.registry).decode()


class FakeClock:
    def __init__(self, engine: FakeEngine, scrape_ns: int = 3_000_000) -> None:
        self.engine, self.scrape_ns, self.t_ns = engine, scrape_ns, 0

    def now(self) -> int:
        return self.t_ns

    def wait(self, seconds: float) -> None:
        self.t_ns += int(seconds * 1e9)

    def fetch(self, url: str, timeout: float) -> str:
        self.engine.run_until(self.t_ns)
        page = self.engine.page()
        self.t_ns += self.scrape_ns  # the scrape itself takes a while
        return page


def scraped(engine: FakeEngine, window_s: float = 60, interval_s: float = 1.0):
    clock = FakeClock(engine)
    return scrape_engine(
        URL, window_s, interval_s, fetch_page=clock.fetch, clock=clock.now, wait=clock.wait
    )


def test_the_fit_recovers_the_model_the_counters_were_made_with():
    cal = calibrate_metrics(scraped(FakeEngine(TRUTH)), source=URL)
    model = cal.model
    assert model.fixed_us == pytest.approx(TRUTH.fixed_us, rel=0.05)
    assert model.per_decode_us == pytest.approx(TRUTH.per_decode_us, rel=0.05)
    assert model.per_prefill_us == pytest.approx(TRUTH.per_prefill_us, rel=0.1)
    assert cal.intervals == 60 and cal.skipped == 0 and cal.prefill_fitted
    assert abs(cal.mean_error) < 0.001  # weighted by steps: the total time is the measured one
    fixed_se, decode_se, prompt_se = cal.stderr_us  # and it knows how sure it is of each cost
    assert 0 < fixed_se < 0.05 * TRUTH.fixed_us and 0 < decode_se < 0.05 * TRUTH.per_decode_us
    assert 0 < prompt_se < 0.1 * TRUTH.per_prefill_us
    # a token's inter-token latency is its step here: the two agree
    assert cal.itl_us == pytest.approx(cal.mean_step_us, rel=0.2)
    # what the counters cannot show is kept, and the fit line says so
    assert model.turnaround_us == StepModel().turnaround_us
    assert model.fit.startswith("fitted on 60 intervals (") and f"of {URL}" in model.fit
    assert "turnaround kept (0us: /metrics cannot show it)" in model.fit
    assert "turnaround kept" in cal.describe()


def test_idle_intervals_are_left_out():
    engine = FakeEngine(TRUTH, idle=((10.2, 14.6), (30.0, 31.5)))
    cal = calibrate_metrics(scraped(engine), source=URL)
    assert cal.model.fixed_us == pytest.approx(TRUTH.fixed_us, rel=0.05)
    assert cal.model.per_decode_us == pytest.approx(TRUTH.per_decode_us, rel=0.05)
    assert cal.skipped >= 6 and cal.intervals == 60 - cal.skipped
    assert any("intervals left out" in n for n in cal.notes)


def test_idle_time_inside_intervals_is_flagged():
    """Idle half of every second, with requests running at each reading: the
    wall time counts the idling, which no token's inter-token latency
    contains. The costs come out twice what they are, and the notes say why."""
    engine = FakeEngine(TRUTH, idle=tuple((k + 0.2, k + 0.7) for k in range(61)))
    cal = calibrate_metrics(scraped(engine), source=URL)
    assert cal.skipped == 0 and cal.mean_step_us > 1.5 * (cal.itl_us or 0)
    assert cal.model.fixed_us > 1.5 * TRUTH.fixed_us
    assert cal.model.per_decode_us > 1.5 * TRUTH.per_decode_us
    assert any("the engine probably idled inside intervals" in n for n in cal.notes)


def test_a_cost_whose_count_never_varies_is_kept_and_said_so():
    cal = calibrate_metrics(scraped(FakeEngine(TRUTH, arrivals=False)), source=URL)
    assert not cal.prefill_fitted
    assert cal.model.per_prefill_us == StepModel().per_prefill_us
    assert "prompt cost kept (60us: its count never varied)" in cal.model.fit
    assert cal.model.fixed_us == pytest.approx(TRUTH.fixed_us, rel=0.05)
    assert cal.model.per_decode_us == pytest.approx(TRUTH.per_decode_us, rel=0.05)


def test_engines_on_one_page_are_told_apart_and_pooled():
    engine = FakeEngine(TRUTH)
    clock = FakeClock(engine)

    def two_engines(url: str, timeout: float) -> str:
        """Engine 0's samples, and the same again as engine 1's."""
        out = []
        for line in clock.fetch(url, timeout).splitlines():
            out.append(line)
            if not line.startswith("#") and 'engine="0"' in line:
                out.append(line.replace('engine="0"', 'engine="1"'))
        return "\n".join(out) + "\n"

    readings = scrape_engine(URL, 20, 1, fetch_page=two_engines, clock=clock.now, wait=clock.wait)
    assert sorted({r.series for r in readings}) == [
        'engine="0",model_name="tiny"',
        'engine="1",model_name="tiny"',
    ]
    cal = calibrate_metrics(readings, source=URL)
    assert cal.intervals == 40 and cal.model.fixed_us == pytest.approx(TRUTH.fixed_us, rel=0.1)
    assert any(n.startswith("2 engines pooled into one model") for n in cal.notes)


def test_a_page_recorded_from_vllm_is_read():
    """The names and labels vLLM 0.32 really prints (recorded from `outrate
    serve` on the tiny model after a load: tests/test_simulate_e2e.py)."""
    (reading,) = parse_page((FIXTURES / "vllm-metrics.txt").read_text(), 0)
    assert reading.series.startswith('engine="0",model_name=')
    assert reading.steps > 0 and reading.decoded > 0 and reading.itl_seconds > 0
    assert reading.generated >= reading.decoded and reading.tokens > reading.generated
    assert reading.running is not None


# -- reading a Prometheus ------------------------------------------------------


class FakePrometheus:
    """Scrapes a FakeEngine every `every_s` (unix time from `start_s`) and
    answers /api/v1/query_range for a bare metric, with a label selector, or
    under timestamp(): the latest scrape at or before each step, as
    Prometheus evaluates an instant vector."""

    def __init__(self, engine: FakeEngine, start_s: float, until_s: float, every_s: float) -> None:
        self.scrapes: list[tuple[float, dict[str, tuple[dict[str, str], float]]]] = []
        self.queries: list[str] = []
        t = start_s
        while t <= until_s:
            engine.run_until(int((t - start_s) * 1e9))
            samples = {}
            for family in text_string_to_metric_families(engine.page()):
                for s in family.samples:
                    labels = {**s.labels, "instance": "engine:8000", "job": "vllm"}
                    if "le" not in labels:
                        samples[s.name] = (labels, s.value)
            self.scrapes.append((t, samples))
            t += every_s

    def fetch(self, url: str, timeout: float) -> str:
        parts = urllib.parse.urlsplit(url)
        assert parts.path == "/api/v1/query_range", url
        q = dict(urllib.parse.parse_qsl(parts.query))
        self.queries.append(q["query"])
        m = re.fullmatch(r"(timestamp\()?([\w:]+)(\{.*\})?\)?", q["query"])
        assert m, q["query"]
        stamp, name, selector = m.group(1), m.group(2), m.group(3) or ""
        wanted = dict(re.findall(r'(\w+)="([^"]*)"', selector))
        start, end, step = float(q["start"]), float(q["end"]), float(q["step"])
        values: list[list[object]] = []
        labels: dict[str, str] = {}
        t = start
        while t <= end:
            latest = [(at, s) for at, s in self.scrapes if at <= t and name in s]
            if latest:
                at, samples = latest[-1]
                labels, value = samples[name]
                if all(labels.get(k) == v for k, v in wanted.items()):
                    values.append([t, str(at if stamp else value)])
            t += step
        metric = {k: v for k, v in labels.items()} | ({} if stamp else {"__name__": name})
        result = [{"metric": metric, "values": values}] if values else []
        return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}})


def test_a_prometheus_gives_the_same_fit():
    start = 1_700_000_000.0
    prom = FakePrometheus(FakeEngine(TRUTH), start, start + 600, every_s=15)
    readings = read_prometheus(
        PROM, 600, 5, '{instance="engine:8000"}', fetch_page=prom.fetch, clock=lambda: start + 600
    )
    assert len(readings) == 41  # one a scrape, though queried every 5 s
    assert len(prom.queries) == 7
    assert all('{instance="engine:8000"}' in q for q in prom.queries)
    assert 'timestamp(vllm:iteration_tokens_total_count{instance="engine:8000"})' in prom.queries
    cal = calibrate_metrics(readings, source=PROM)
    assert cal.model.fixed_us == pytest.approx(TRUTH.fixed_us, rel=0.05)
    assert cal.model.per_decode_us == pytest.approx(TRUTH.per_decode_us, rel=0.05)
    assert cal.model.per_prefill_us == pytest.approx(TRUTH.per_prefill_us, rel=0.15)
    assert readings[0].series == 'engine="0",instance="engine:8000",job="vllm",model_name="tiny"'


def test_a_prometheus_without_the_series_says_so():
    start = 1_700_000_000.0
    prom = FakePrometheus(FakeEngine(TRUTH), start, start + 60, every_s=15)
    with pytest.raises(OutrateError) as e:
        read_prometheus(
            PROM, 60, 5, '{instance="other:8000"}', fetch_page=prom.fetch, clock=lambda: start + 60
        )
    assert str(e.value) == (
        f'{PROM}: no vllm:iteration_tokens_total_count{{instance="other:8000"}} in the last 60s: '
        "is Prometheus scraping a vLLM engine (and is --match right)? An engine's own page "
        "ends in /metrics."
    )


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ("<html>Prometheus Time Series Collection</html>", "not a Prometheus API answer"),
        ('{"status": "error", "error": "parse error at char 3"}', "Prometheus says parse error"),
        ('{"status": "success"}', "not a Prometheus API answer"),
    ],
)
def test_what_is_not_a_prometheus_answer_is_refused(answer, message):
    with pytest.raises(OutrateError) as e:
        read_prometheus(PROM, 60, 5, fetch_page=lambda url, timeout: answer, clock=lambda: 1e9)
    assert str(e.value).startswith(f"{PROM}/api/v1/query_range?query=vllm")
    assert message in str(e.value)


def test_match_is_a_selector_and_only_for_a_prometheus():
    with pytest.raises(OutrateError, match=r"--match 'instance=x': a PromQL label selector"):
        read_metrics(PROM, 60, 1, "instance=x")
    with pytest.raises(OutrateError, match=r"--match selects a Prometheus's series"):
        read_metrics(URL, 60, 1, '{instance="x"}')


# -- bad input -----------------------------------------------------------------


def test_an_unreachable_url_is_named():
    url = f"http://127.0.0.1:{_closed_port()}/metrics"
    with pytest.raises(OutrateError) as e:
        scrape_engine(url, 60, 1)
    assert str(e.value).startswith(f"cannot read {url}: ")


def test_an_unreachable_prometheus_is_named():
    base = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(OutrateError) as e:
        read_prometheus(base, 60, 1)
    assert str(e.value).startswith(f"cannot read {base}/api/v1/query_range?query=vllm")
    assert str(e.value).endswith(
        "(read as a Prometheus server: an engine's own page ends in /metrics)"
    )


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("page", "message"),
    [
        (
            '# TYPE outrate_live_requests gauge\noutrate_live_requests{limit="a"} 1\n',
            "has no vllm:iteration_tokens_total_count: not a vLLM /metrics page "
            "(or the engine runs with --disable-log-stats)",
        ),
        ("<html><body>hello</body></html>\n", "is not a Prometheus metrics page"),
        (
            "vllm:iteration_tokens_total_count 3\nvllm:iteration_tokens_total_sum 9\n",
            "has no vllm:generation_tokens_total: not vLLM V1's metrics",
        ),
    ],
)
def test_a_page_that_is_not_vllm_metrics_is_named(page, message):
    with pytest.raises(OutrateError) as e:
        scrape_engine(URL, 60, 1, fetch_page=lambda url, timeout: page, clock=lambda: 0)
    assert str(e.value) == f"{URL} {message}"


def test_a_window_without_traffic_says_so():
    engine = FakeEngine(TRUTH, idle=((0, 1000),))
    with pytest.raises(OutrateError) as e:
        calibrate_metrics(scraped(engine), source=URL)
    assert str(e.value) == (
        f"{URL}: the engine took no steps in the 60s read "
        "(vllm:iteration_tokens_total_count did not move): read it while it serves a load"
    )


def test_a_window_too_short_to_fit_says_so():
    with pytest.raises(OutrateError) as e:
        calibrate_metrics(scraped(FakeEngine(TRUTH), window_s=3), source=URL)
    assert str(e.value) == (
        f"{URL}: 3 of 3 intervals had steps and requests running throughout; 5 are needed "
        "(a longer --window, a shorter --interval, or a busier engine)"
    )
    with pytest.raises(OutrateError, match="fewer than two readings"):
        calibrate_metrics(scraped(FakeEngine(TRUTH), window_s=0.5), source=URL)


# -- the command -----------------------------------------------------------------


def cli(*args: str):
    return runner.invoke(app, ["simulate", "calibrate", *args])


@pytest.fixture
def fake_engine_page(monkeypatch):
    """The command's scrape loop on the fake engine and clock."""
    clock = FakeClock(FakeEngine(TRUTH))
    monkeypatch.setattr(counters, "fetch", clock.fetch)
    monkeypatch.setattr(counters, "monotonic_ns", clock.now)
    monkeypatch.setattr(counters, "sleep", clock.wait)
    return clock


def test_calibrate_metrics_writes_the_model(tmp_path, fake_engine_page):
    out = tmp_path / "model.json"
    result = cli("--metrics", URL, "--window", "30", "--interval", "0.5", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert f"reading {URL} every 0.5s for 30s" in result.stderr
    assert "fitted on 60 intervals" in result.stdout
    model = load_step_model(out)
    assert model.fixed_us == pytest.approx(TRUTH.fixed_us, rel=0.1)
    assert "/metrics cannot show it" in model.fit
    data = json.loads(cli("--metrics", URL, "--format", "json").stdout)
    assert data["intervals"] == 60 and data["model"]["turnaround_us"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "Invalid value for --trace / --metrics: give one"),
        (("--trace", "t.jsonl", "--metrics", URL), "Invalid value for --trace / --metrics"),
        (("--metrics", URL, "-w", "load.yaml"), "they go with --trace"),
        (("--trace", "t.jsonl", "--match", '{job="x"}'), "Invalid value for --match"),
    ],
)
def test_calibrate_wants_a_trace_or_metrics(args, message):
    result = cli(*args)
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_calibrate_metrics_errors_name_the_url():
    url = f"http://127.0.0.1:{_closed_port()}/metrics"
    result = cli("--metrics", url)
    assert result.exit_code == 1 and f"cannot read {url}: " in result.stderr
