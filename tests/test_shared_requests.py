"""Request rates (`requests:`) shared by API servers through the store
(vllm_integration/apiserver/store.py, outrate/contract/requests.py with a
lender), on a real redis-server: two API servers' request tables, each with
its lease thread, as `open_requests` builds them at app startup, asked 200
times a second each for one user limited to 10 requests/s. Real time: the
global GCRA runs on the store's TIME. What each table admitted is merged and
checked against docs/client-contract.md's bound, `(W + burst) * rate + 1 +
S`, in every window; then the store stops and each paces at rate / 2."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("redis")

from redis_support import RedisServer  # noqa: E402

from outrate.budget.shared.lease import API_SERVERS_KEY, ENGINES_KEY  # noqa: E402
from outrate.contract.requests import MAX_WAIT_NS, RequestTable, admit_waiting  # noqa: E402
from outrate.observe.trace import engine_rate, max_window_excess  # noqa: E402
from outrate.policy.compiler import compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402
from vllm_integration.apiserver.store import open_requests  # noqa: E402

pytestmark = pytest.mark.waits  # make test's waits lane (tests/lanes.py)

RATE = 10
TEXT = (
    f"version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  u: {{rate: 20, requests: {RATE}}}\n"
)
POLICY = compile_policy(parse_policy(TEXT, "t.yaml"), "t.yaml", "sha-t")
BURST_NS = POLICY.requests.limit_for("u").burst_ns


class ApiServer:
    """One API-server process's request table and lease thread."""

    def __init__(self, url: str) -> None:
        self.table, runner = open_requests({"store": url}, POLICY)
        assert runner is not None
        self.runner = runner
        self.admitted: list[tuple[int, int]] = []
        self.waits: list[int] = []
        self._retry_at = 0

    def ask(self, user: str = "u") -> None:
        """One request, as the middleware asks: a refusal for credit on its
        way is asked again after `pending_ns` (here: at a later tick)."""
        now = time.monotonic_ns()
        if now < self._retry_at:
            return
        a = self.table.admit(POLICY, user)
        if a.pending_ns:
            self.waits.append(a.pending_ns)
            self._retry_at = now + a.pending_ns
        elif a.admitted:
            self.admitted.append((now, 1))


def drive(servers: list[ApiServer], seconds: float, events=()) -> dict[str, int]:
    marks: dict[str, int] = {}
    pending = list(events)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        while pending and time.monotonic() - t0 >= pending[0][0]:
            action = pending.pop(0)[1]
            action()
            marks[action.__name__] = time.monotonic_ns()
        for s in servers:
            s.ask()
        time.sleep(0.005)
    return marks


def slack(servers: list[ApiServer]) -> float:
    h = max(s.runner.max_horizon_us for s in servers) / 1e6
    return RATE * (h + max(0.0, h - BURST_NS / 1e9)) + len(servers)


def test_two_api_servers_share_one_request_rate(tmp_path):
    """~400 requests/s asked over two API servers for a user allowed 10/s:
    together they admit ~10/s, within the bound in every window, each its
    part; a user's first request on each waits for credit (pending_ns, at
    most MAX_WAIT_NS) instead of being refused; the API servers heartbeat
    apart from the engines; an unlimited user is never asked to wait."""
    server = RedisServer(tmp_path).start()
    try:
        servers = [ApiServer(server.url) for _ in range(2)]
        drive(servers, 4.0)
        assert all(s.table.admit(POLICY, "free") == s.table.admit(POLICY, "free") for s in servers)
        assert servers[0].table.admit(POLICY, "free").admitted
        client = server.client()
        api = client.hgetall(API_SERVERS_KEY)
        engines = client.hgetall(ENGINES_KEY)
        for s in servers:
            s.runner.stop()
    finally:
        server.stop()
    counts = [len(s.admitted) for s in servers]
    merged = sorted(t for s in servers for t in s.admitted)
    excess = max_window_excess(merged, RATE, BURST_NS)
    rate = engine_rate([t for t in merged if t[0] >= merged[0][0] + BURST_NS + 500_000_000])
    print(
        f"requests admitted {counts} (burst {BURST_NS / 1e9:g} s), {rate:.2f}/s together past "
        f"the burst, worst window {excess:+.2f} "
        f"(slack {slack(servers):.2f}); first waits "
        f"{[round(s.waits[0] / 1e6, 1) if s.waits else None for s in servers]} ms"
    )
    assert excess <= slack(servers)
    assert 0.85 * RATE <= rate <= 1.1 * RATE  # one rate, not one per API server
    assert min(counts) >= 0.3 * sum(counts)
    assert all(s.waits and 0 < s.waits[0] <= MAX_WAIT_NS for s in servers)
    assert len(api) == 2 and not engines  # not counted as engines


def test_a_first_request_waits_for_a_late_grant(tmp_path):
    """A store that answers late (redis-server stopped for 0.3 s: a loaded
    machine's lease round, which took over 100 ms beside a busy loop): a
    user's first request waits for its grant (`admit_waiting`, as the
    middleware asks) and is admitted, not refused for credit on its way."""
    import asyncio
    import threading

    server = RedisServer(tmp_path).start()
    resume = threading.Timer(0.3, server.resume)
    try:
        api = ApiServer(server.url)
        time.sleep(0.2)  # the lease thread's rounds under way
        server.pause()
        resume.start()
        t0 = time.monotonic()
        a = asyncio.run(admit_waiting(api.table, POLICY, "u"))
        waited = time.monotonic() - t0
        api.runner.stop()
    finally:
        resume.cancel()
        server.resume()
        server.stop()
    print(f"first request: admitted {a.admitted} after {waited * 1000:.0f} ms")
    assert a.admitted and 0.25 <= waited < MAX_WAIT_NS / 1e9


def test_a_store_outage_paces_requests_at_rate_over_n(tmp_path, caplog):
    """The store stops under two API servers for 3 s: each admits at most
    rate / 2 (its own GCRA bound at 5/s), none waits on the store, and after
    it is back (empty) they share the rate again."""
    server = RedisServer(tmp_path).start()
    try:
        servers = [ApiServer(server.url) for _ in range(2)]

        def store_down() -> None:
            server.stop()

        def store_back() -> None:
            server.start()

        marks = drive(servers, 9.0, [(2.0, store_down), (5.0, store_back)])
        for s in servers:
            s.runner.stop()
    finally:
        server.stop()
    down, back = marks["store_down"], marks["store_back"]
    inside = [[t for t in s.admitted if down + 500_000_000 <= t[0] < back] for s in servers]
    alone = [max_window_excess(x, RATE / 2, BURST_NS) for x in inside]
    after = sorted(t for s in servers for t in s.admitted if t[0] >= back + 2_000_000_000)
    merged = sorted(t for s in servers for t in s.admitted)
    excess = max_window_excess(merged, RATE, BURST_NS)
    print(
        f"outage: admitted {[len(x) for x in inside]} in 2.5 s (alone at rate/2: "
        f"{[round(x, 2) for x in alone]}); whole run worst window {excess:+.2f} (slack "
        f"{slack(servers) + 2:.2f}); after {engine_rate(after):.2f}/s"
    )
    assert all(x <= 1.0 for x in alone)
    assert all(len(x) >= 0.8 * (RATE / 2) * 2.5 for x in inside)  # served, not paused
    assert excess <= slack(servers) + len(servers)
    assert 0.8 * RATE <= engine_rate(after) <= 1.1 * RATE


def test_without_a_store_each_api_server_keeps_its_own_table():
    table, runner = open_requests({}, POLICY)
    assert runner is None and isinstance(table, RequestTable) and table.lender is None


def test_an_api_server_leases_requests_only_once_a_rule_has_a_request_rate(redis_server):
    """No request rate in the policy: no lease thread (nor its log lines)
    in the API server; a reload that adds one starts it."""
    from vllm_integration.apiserver.identity import Gate

    plain = compile_policy(parse_policy("version: 1\ndefault: 20\n", "t.yaml"), "t.yaml")
    gate = Gate(policy=plain)
    gate.store = {"store": redis_server.url}
    gate.share_requests(plain)
    assert gate.lease is None and gate.requests.lender is None
    gate.publish(POLICY)
    try:
        assert gate.lease is not None and gate.lease.up
        assert gate.requests.lender is not None
        assert gate.requests.admit(POLICY, "free").admitted
    finally:
        gate.stop()
