"""`--api-server-count 2` on a real `outrate serve`: vLLM spawns two API-server
processes, and each must apply outrate's identity rules (its own gate and
reloader), and serve outrate's metrics on /metrics (vLLM switches Prometheus
to multiprocess mode, where /metrics holds only what the multiprocess
collector yields).

Which API server answers a connection is vLLM's choice (the least loaded), so
the tests send requests eight at a time, which spreads them, and read which
process logged each request (`--enable-log-requests`). Who was charged is
read from the engine's trace. One server for the module.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from build_tiny_model import build  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serverproc import HOST, ServerProcess, outrate_serve_argv  # noqa: E402

from outrate.observe.trace import read_trace  # noqa: E402

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent


def policy(header: str) -> str:
    return (
        "version: 1\ndefault: unlimited\nanonymous: unlimited\n"
        "users:\n  alice: 500\n  bob: 500\n"
        f"identity:\n  source: header\n  header: {header}\n"
    )


@contextlib.contextmanager
def api_servers_up(workdir: Path):
    """The module's server."""
    path = workdir / "policy.yaml"
    path.write_text(policy("x-user"))
    argv = outrate_serve_argv(
        build(REPO / "models" / "tiny-llama"),
        path,
        "--api-server-count", "2",
        "--outrate-trace", str(workdir / "trace.jsonl"),
        "--enable-log-requests",  # each request logged by the process that took it
    )  # fmt: skip
    proc = ServerProcess(argv, log_path=workdir / "server.log", name="api-servers")
    try:
        proc.start(timeout_s=300)
        proc.policy = path
        proc.trace = workdir / "trace.jsonl"
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def apis(tmp_path_factory):
    with api_servers_up(tmp_path_factory.mktemp("api-servers")) as value:
        yield value


def post(apis: ServerProcess, path: str, body: dict, headers: dict[str, str]) -> tuple[int, bytes]:
    c = http.client.HTTPConnection(HOST, apis.port, timeout=60)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def at_once(calls: list[Callable[[], object]]) -> list[object]:
    """Concurrent calls, each on its own connection: vLLM hands a connection to
    its least loaded API server, so requests in flight together spread."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def complete(header: str, user: str, request_id: str) -> tuple[dict, dict[str, str]]:
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 4,
        "ignore_eos": True,
        "request_id": request_id,
    }
    return body, {header: user, "X-Request-Id": request_id}


_LOGGED = re.compile(r"^\((\w+) pid=(\d+)\).*Received request (\S+?):")


def who_logged(apis: ServerProcess) -> dict[str, str]:
    """request id -> the process that logged it (`<name> pid=<pid>`)."""
    out = {}
    for line in Path(apis.log_path).read_text(errors="replace").splitlines():
        m = _LOGGED.match(line)
        if m:
            out[m.group(3)] = f"{m.group(1)} pid={m.group(2)}"
    return out


def charged(apis: ServerProcess, since: int) -> Counter[str]:
    total: Counter[str] = Counter()
    for r in read_trace(apis.trace):
        if "step" in r and r["t"] >= since:
            total.update(r.get("charged", {}))
    return total


def expect_charged(apis: ServerProcess, since: int, want: dict[str, int]) -> None:
    """The trace (written every 100 ms, later on a busy machine) shows `want`."""
    wait_until(lambda: charged(apis, since) == want, f"charged {want}", 10)


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def run_on_both(apis: ServerProcess, header: str, user: str, tag: str) -> list[str]:
    """Eight completions at once; their request ids."""
    ids = [f"{tag}-{n}-{time.monotonic_ns()}" for n in range(8)]

    def one(rid: str) -> Callable[[], None]:
        def call() -> None:
            status, answer = post(apis, "/v1/completions", *complete(header, user, rid))
            assert status == 200, answer
            assert json.loads(answer)["usage"]["completion_tokens"] == 4

        return call

    at_once([one(rid) for rid in ids])
    return ids


def served_by(apis: ServerProcess, ids: list[str]) -> set[str]:
    wait_until(lambda: all(any(i in k for k in who_logged(apis)) for i in ids), "logged")
    logged = who_logged(apis)
    return {p for k, p in logged.items() if any(i in k for i in ids)}


def on_both_servers(apis: ServerProcess, header: str, user: str, tag: str) -> None:
    """Batches of eight until both API servers have taken some (usually the
    first batch; on a loaded machine one process took every connection of
    five batches once: the kernel hands an accept to whichever event loop
    waits, and a 4-token answer is done before the other one wakes): every
    batch is charged to `user`, and to nobody else."""
    seen: set[str] = set()
    for _ in range(15):
        since = time.monotonic_ns()
        ids = run_on_both(apis, header, user, tag)
        expect_charged(apis, since, {user: 32})
        seen |= served_by(apis, ids)
        if len(seen) == 2:
            return
    raise AssertionError(f"every batch went to one API server: {seen}")


def test_both_api_servers_apply_the_identity_header(apis):
    on_both_servers(apis, "x-user", "alice", "hdr")


def test_an_edit_reaches_every_api_server(apis):
    apis.policy.write_text(policy("x-team-user"))

    def applied() -> bool:  # bob named by the new header, charged to bob everywhere
        since = time.monotonic_ns()
        run_on_both(apis, "x-team-user", "bob", "probe")
        try:
            expect_charged(apis, since, {"bob": 32})
        except AssertionError:
            return False
        return True

    wait_until(applied, "the edit in both API servers", 60)
    on_both_servers(apis, "x-team-user", "bob", "edited")


def scrape(apis: ServerProcess) -> dict[str, dict[str, float]]:
    c = http.client.HTTPConnection(HOST, apis.port, timeout=60)
    try:
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
    finally:
        c.close()
    types = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE"))
    assert all(n == 1 for name, n in types.items() if name.startswith("outrate_")), types
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("outrate_") and "limit" in s.labels:
                out.setdefault(s.name, {})[s.labels["limit"]] = s.value
    return out


def test_every_api_server_serves_outrate_metrics(apis):
    """16 scrapes, 8 of them at once: every one has outrate's families, once
    each, with the tokens the engine's trace charged (before the fix, none
    had them: the instrumentator's multiprocess registry held vLLM's alone)."""
    totals = charged(apis, 0)  # everything so far (bob's also has the edit's probes)
    want = {user: float(totals[user]) for user in ("alice", "bob")}
    assert want["alice"] >= 32 and want["bob"] >= 32

    def tokens() -> dict[str, float]:
        got = scrape(apis).get("outrate_output_tokens_total", {})
        return {k: v for k, v in got.items() if k in want}

    wait_until(lambda: tokens() == want, f"the trace's totals {want} on /metrics", 5)
    assert at_once([tokens] * 8) == [want] * 8
    assert [tokens() for _ in range(8)] == [want] * 8
