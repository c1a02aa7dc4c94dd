"""What a client is told, on a real `outrate serve` (issue 41): the rate-limit
header fields read by the official openai client, the 429 path with
Retry-After honoured by its retries, and a flood of one user's requests
refused before tokenization while another user's first tokens keep coming.

On the session's server (tests/e2e_support.py), given this module's policy
by hot reload, the base policy back at the end. The API server reloads the
policy on its own (its reloader: vllm_integration/apiserver/identity.py), so
each change is awaited on the header fields of a probe through the guard.

The flood's TTFT is judged on what the engine recorded (`arrived` -> `first`
in its token trace); client-side figures are printed beside it, a sanity
check only on two shared cores.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import pytest

pytest.importorskip("vllm")

import httpx  # noqa: E402
import openai  # noqa: E402
from e2e_support import POLICY, trace_steps, use_policy, wait_idle  # noqa: E402
from loadgen import client, stream_completion  # noqa: E402
from test_contract import check_draft_fields  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

MODEL = "tiny"
FLOOD_RATE = 5
LIMITS = POLICY + (
    f"  flood: {{rate: 50, requests: {FLOOD_RATE}}}\n"
    "  bob: 100\n"
    "  reader: {rate: 40, requests: 10/min, prompt: 4000}\n"
    "  retrier: {rate: unlimited, requests: 2}\n"
    "  probe: {rate: 7, requests: 100000}\n"
)


def _probe(server) -> dict[str, str]:
    r = httpx.post(
        f"{server.root_url}/tokenize",
        json={"model": MODEL, "prompt": "x", "vllm_xargs": {"output_rate_user": "probe"}},
        timeout=30,
        trust_env=False,
    )
    return dict(r.headers)


def _wait_api_server(server, applied, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not applied(_probe(server)):
        if time.monotonic() > deadline:
            raise AssertionError(f"the API server did not apply {what} within {timeout_s} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(server):
    wait_idle(server)
    use_policy(server, LIMITS)
    _wait_api_server(
        server, lambda h: "output;q=7;w=1" in h.get("ratelimit-policy", ""), "this policy"
    )
    yield server
    wait_idle(server)
    use_policy(server, POLICY)
    _wait_api_server(server, lambda h: "ratelimit-policy" not in h, "the base policy")


def _user(name: str | None) -> dict:
    return {"vllm_xargs": {"output_rate_user": name}} if name else {}


def _fields(headers) -> dict[bytes, bytes]:
    return {k.lower().encode(): v.encode() for k, v in headers.items()}


def test_the_openai_client_reads_the_limits_on_every_route(server):
    api = client(server.base_url)
    reader = _user("reader")
    began = time.monotonic()
    chat = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=reader
    )
    assert chat.parse().choices[0].message is not None
    streamed = api.completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=2, stream=True, extra_body=reader
    )
    assert len(list(streamed.parse())) >= 1  # the stream is read after its head
    done = api.completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body=reader
    )
    assert done.parse().choices
    responses = api.responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=2, extra_body=reader
    )
    assert responses.parse().output is not None
    took = time.monotonic() - began
    remaining = []
    for raw in (chat, streamed, done, responses):
        h = raw.headers
        check_draft_fields(_fields(h))
        assert h["ratelimit-policy"] == (
            'requests;q=10;w=60, output;q=40;w=1;qu="output-tokens", '
            'prompt;q=4000;w=1;qu="prompt-tokens"'
        )
        assert h["x-ratelimit-limit-requests"] == "10"
        assert h["x-ratelimit-limit-tokens"] == "2400"
        assert h["x-ratelimit-limit-input-tokens"] == "240000"
        remaining.append(int(h["x-ratelimit-remaining-requests"]))
        assert h["ratelimit"] == f"requests;r={remaining[-1]};t={h['ratelimit'].split('t=')[1]}"
    # 10 a minute: all at once, then one back every 6 s. Each request takes
    # one; what came back meanwhile is at most took / 6 s.
    refilled = int(took // 6)
    for i, left in enumerate(remaining):
        assert 9 - i <= left <= 9 - i + refilled, (remaining, took)
    # no identity: the anonymous rule's limits (30 tok/s, no request rate)
    anon = api.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
    assert anon.headers["ratelimit-policy"] == 'output;q=30;w=1;qu="output-tokens"'
    assert "ratelimit" not in anon.headers and "x-ratelimit-limit-requests" not in anon.headers


def _refused(server) -> float:
    text = httpx.get(f"{server.root_url}/metrics", timeout=30, trust_env=False).text
    for line in text.splitlines():
        if line.startswith("outrate_requests_refused_total{") and 'limit="retrier"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_retrying_client_waits_as_told_and_gets_through(server):
    """retrier: 2 requests a second. The third at once gets 429 with
    Retry-After (and retry-after-ms, which the openai client honours first);
    with retries on, it waits ~0.5 s and gets through."""
    refused_before = _refused(server)
    strict = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    for _ in range(2):
        strict.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body=_user("retrier")
        )
    with pytest.raises(openai.RateLimitError) as info:
        strict.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body=_user("retrier")
        )
    refusal = info.value.response
    assert refusal.status_code == 429
    assert refusal.headers["retry-after"] == "1"
    assert 1 <= int(refusal.headers["retry-after-ms"]) <= 500
    assert refusal.json()["error"]["code"] == "rate_limit_exceeded"
    assert refusal.json()["error"]["type"] == "requests"
    check_draft_fields(_fields(refusal.headers))
    patient = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=3, timeout=60)
    began = time.monotonic()
    for _ in range(3):  # the bucket is empty: each waits about 0.5 s
        patient.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body=_user("retrier")
        )
    waited = time.monotonic() - began
    print(f"\n3 requests through a retrying client at 2/s: {waited:.2f} s")
    assert waited >= 1.0
    assert _refused(server) - refused_before >= 2


def _bob_ttft(server) -> tuple[list[float], list[float]]:
    """bob's time to first token of 6 short requests one after another:
    (engine: arrived -> first, from the trace; client: sent -> first chunk), ms."""
    api = client(server.base_url)
    since = time.monotonic_ns()
    clients = []
    for _ in range(6):
        s = stream_completion(api, "bob", 2)
        assert s.error is None, s.error
        clients.append(1000 * (s.ttft or 0.0))
    lines = trace_steps(server, since)
    arrived = [r["t"] for r in lines for _ in range(r.get("arrived", {}).get("bob", 0))]
    first = [r["t"] for r in lines for _ in range(r.get("first", {}).get("bob", 0))]
    assert len(arrived) == len(first) == 6, (arrived, first)
    return [(f - a) / 1e6 for a, f in zip(arrived, first, strict=True)], clients


async def _flood(url: str, per_s: int, seconds: float) -> tuple[list[int], float, float]:
    """`per_s` completions a second of user flood, open loop, for `seconds`:
    each status, when the first was sent and when the last answer came."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, **_user("flood")}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60, trust_env=False) as http:
        began = time.monotonic()

        async def one(i: int) -> int:
            await asyncio.sleep(max(0.0, began + i / per_s - time.monotonic()))
            r = await http.post("/completions", json=body)
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
            return r.status_code

        statuses = await asyncio.gather(*(one(i) for i in range(int(per_s * seconds))))
        return list(statuses), began, time.monotonic()


def test_a_request_flood_is_refused_before_it_costs_anyone(server):
    """flood sends 200 requests/s against its 5/s for 3 s: all but the
    allowance (5 at once, then 5 a second) get 429; bob's first tokens,
    measured before and during, stay within 2x of alone on the engine's record."""
    alone_engine, alone_client = _bob_ttft(server)
    result: dict[str, object] = {}

    def run_flood() -> None:
        result["flood"] = asyncio.run(_flood(server.base_url, 200, 3.0))

    flood = threading.Thread(target=run_flood)
    flood.start()
    time.sleep(0.5)
    during_engine, during_client = _bob_ttft(server)
    flood.join(timeout=120)
    statuses, began, ended = result["flood"]  # type: ignore[misc]
    admitted, refused = statuses.count(200), statuses.count(429)
    span = ended - began
    p50 = statistics.median
    print(
        f"\nflood: {len(statuses)} requests in {span:.2f} s: {admitted} admitted, {refused} "
        f"refused (429); allowance {FLOOD_RATE} + {FLOOD_RATE}/s"
        f"\nbob TTFT p50 alone: engine {p50(alone_engine):.1f} ms, client "
        f"{p50(alone_client):.1f} ms; during the flood: engine {p50(during_engine):.1f} ms, "
        f"client {p50(during_client):.1f} ms"
    )
    assert admitted + refused == len(statuses)
    assert admitted <= FLOOD_RATE * span + FLOOD_RATE + 1
    assert admitted >= FLOOD_RATE + FLOOD_RATE * 2  # the allowance of about 3 s, less slack
    step_ms = 10.0  # one decode step of the tiny model here, at most
    assert p50(during_engine) <= 2 * p50(alone_engine) + step_ms
