"""A real Prometheus for the tests (tests/test_ops.py), on 127.0.0.1 and a
free port, with its own config and a temporary storage directory; and what
the tests need to read PromQL: the metric names an expression uses.

The binaries come from Debian's `prometheus` package (`prometheus` and
`promtool`), which `make test` installs when it runs as root
(ops/install-prometheus.sh). `OUTRATE_PROMETHEUS=/path/to/prometheus` names
another build; promtool is looked up beside it, then on PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from serverproc import free_port

INSTALL_HINT = (
    "prometheus/promtool not installed: `make test` installs them as root "
    "(ops/install-prometheus.sh: apt-get install --no-install-recommends prometheus)"
)


def without_prometheus() -> None:
    """Skip, saying why; under CI (`CI` set, as `.ci/run` runs) fail instead,
    so a broken install can never turn the checks of the dashboard and the
    rules into a green skip."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{INSTALL_HINT}; CI requires them", pytrace=False)
    pytest.skip(INSTALL_HINT)


def binaries() -> tuple[str, str] | None:
    """(prometheus, promtool), or None where either is missing."""
    prometheus = os.environ.get("OUTRATE_PROMETHEUS") or shutil.which("prometheus")
    if not prometheus:
        return None
    beside = Path(prometheus).with_name("promtool")
    promtool = str(beside) if beside.exists() else shutil.which("promtool")
    return (prometheus, promtool) if promtool else None


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PrometheusError(RuntimeError):
    pass


class PrometheusServer:
    """One prometheus process scraping `targets` (host:port) every
    `scrape_interval` as job `job`, evaluating `rule_files` as often."""

    def __init__(
        self,
        directory: Path,
        targets: list[str],
        rule_files: list[Path],
        job: str = "vllm",
        scrape_interval: str = "1s",
    ) -> None:
        found = binaries()
        if found is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = found[0]
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.job = job
        self.config = self.directory / "prometheus.yml"
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
        }
        self.config.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.log_path = self.directory / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30) -> PrometheusServer:
        argv = [
            self.binary,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_path.read_text()[-2000:]}")
            try:
                with _opener.open(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout_s} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def api(self, path: str, **params: Any) -> Any:
        """`data` of an HTTP API answer; PrometheusError with Prometheus's own
        message (a PromQL parse error names the position) otherwise."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with _opener.open(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's samples (a scalar comes back as one sample)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def names(self) -> set[str]:
        """Every metric name Prometheus holds: scraped and recorded."""
        return set(self.api("label/__name__/values"))

    def wait_for(self, expr: str, timeout_s: float = 30) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)


def value(sample: dict[str, Any]) -> float:
    return float(sample["value"][1])


# -- PromQL: the metric names an expression uses ---------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])")
_KEYWORDS = frozenset(
    "and or unless by without on ignoring group_left group_right bool offset inf nan".split()
)


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside strings, label
    matchers, ranges and label lists that are not functions or keywords.
    (`{__name__="x"}` selectors are not used in ops/ and not recognised.)"""
    text = _STRING.sub('""', expr)
    text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name = m.group(1)
        if name.lower() in _KEYWORDS or re.match(r"\s*\(", text[m.end() :]):
            continue  # a keyword or a function call
        names.add(name)
    return names


# -- promtool on a page's samples -----------------------------------------------

PROMTOOL_STEPS = 12
"""Samples per input series: 15 s apart, 2m45s, so `eval_time: 2m` has a full
minute of history behind it for rate()."""


def page_series(
    text: str, names: set[str], counters: set[str] = frozenset(), instance: str = "e:8000"
) -> list[dict[str, str]]:
    """promtool input series from the samples named `names` on a /metrics
    page (what an exporter really wrote, labels and all): a gauge holds its
    value all along; a counter (a name in `counters`) grows by its value
    every 15 s step, so rate() over it is value / 15."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name not in names:
                continue
            labels = {"job": "vllm", "instance": instance, **s.labels}
            body = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            v = f"{s.value:g}"
            values = f"0+{v}x{PROMTOOL_STEPS}" if s.name in counters else f"{v}x{PROMTOOL_STEPS}"
            out.append({"series": f"{s.name}{{{body}}}", "values": values})
    return out


def promtool_expect(
    promtool: str, directory: Path, series: list[dict[str, str]], cases: list[dict[str, Any]]
) -> None:
    """Each case ({"expr", "exp_samples"}) evaluated by promtool (Prometheus's
    own PromQL engine) at 2m over `series`; an AssertionError with promtool's
    report (got and expected) otherwise."""
    import yaml

    spec = {
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [{"eval_time": "2m", **c} for c in cases],
            }
        ]
    }
    path = Path(directory) / "panels.test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    run = subprocess.run(
        [promtool, "test", "rules", path.name],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr
