"""Token quotas on the session's `outrate serve` (issue 41 item 3): a spent
quota refuses the user's next request with 429 `insufficient_quota` and
Retry-After up to the UTC window's reset, read with the openai client; a
hot reload of the quota keeps the usage already counted; others are not
refused; every response says each quota in force, what is left of it as
counted and when it resets (the header fields, read with the openai
client's raw responses); and a restart of the server hands nobody a fresh
day (last: it starts the engine and API server afresh, /metrics too)."""

from __future__ import annotations

import calendar
import json
import re
import time

import pytest

pytest.importorskip("vllm")

import openai  # noqa: E402
from e2e_support import POLICY, restart, use_policy, wait_idle  # noqa: E402
from loadgen import client  # noqa: E402
from test_contract import check_draft_fields  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from outrate.budget.quotafile import SAVE_INTERVAL_S  # noqa: E402
from outrate.cli import app  # noqa: E402
from outrate.contract.quotas import READ_INTERVAL_S  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

MODEL = "tiny"
QUOTA = 40
READER = 1000


def _policy(quota: int) -> str:
    return POLICY + (
        f"  quota-user: {{rate: unlimited, quota: {{output: {quota}/day}}}}\n"
        "  quota-free: {rate: unlimited, quota: {output: 1M/day}}\n"
        f"  quota-reader: {{rate: 40, quota: {{output: {READER}/day, prompt: 5K/hour}}}}\n"
    )


@pytest.fixture(scope="module")
def server(server):
    wait_idle(server)
    use_policy(server, _policy(QUOTA))
    time.sleep(0.5)  # the API server's own reloader (debounce ~150 ms)
    yield server
    wait_idle(server)
    use_policy(server, POLICY)
    time.sleep(0.5)


def _complete(api, user: str, tokens: int):
    return api.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=tokens,
        extra_body={"vllm_xargs": {"output_rate_user": user}, "ignore_eos": True},
    )


def _until_refused(api, user: str, timeout_s: float = 10) -> tuple[openai.RateLimitError, float]:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            _complete(api, user, 1)
        except openai.RateLimitError as e:
            return e, time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{user} was not refused within {timeout_s} s")


def _used(server, user: str, key: str = "output/day") -> int:
    data = json.loads(server.quota_path.read_text())
    return int(data["users"].get(user, {}).get(key, [0, 0])[1])


def _midnight_s(now: float) -> float:
    """Seconds from `now` to the next midnight UTC (the day window's reset)."""
    return calendar.timegm(time.gmtime(now)[:3] + (0, 0, 0)) + 86400 - now


def _resets_at_midnight(reset_s: float, before: float, after: float) -> bool:
    """A reset a response said: the seconds to the next UTC midnight from a
    moment while its request was in flight (`before` to `after`, wall
    clock), give or take the second an integer header rounds to. Bracketed,
    not read against the time the test looks: on a busy machine seconds
    pass between the header and the look."""
    return _midnight_s(after) - 1 <= reset_s <= _midnight_s(before) + 1


def _fields(headers) -> dict[bytes, bytes]:
    return {k.lower().encode(): v.encode() for k, v in headers.items()}


def _until_saved(server, user: str, at_least: int, timeout_s: float = 10) -> int:
    """The file's count once it holds `at_least` (the engine saves every second)."""
    deadline = time.monotonic() + timeout_s
    while (used := _used(server, user)) < at_least:
        assert time.monotonic() < deadline, f"{user}: {used} of {at_least} saved"
        time.sleep(0.05)
    return used


def test_every_response_says_what_is_left_of_each_quota(server):
    """quota-reader: 1000 output tokens a day, 5,000 prompt tokens an hour.
    Streamed or not, each response carries both quotas in both styles, with
    the amount left as counted when the request was admitted: once the first
    request's usage is saved and read, the next response says exactly what
    the file holds, and its reset is the next UTC midnight."""
    api = client(server.base_url).with_options(max_retries=0)
    reader = {"vllm_xargs": {"output_rate_user": "quota-reader"}, "ignore_eos": True}
    first = api.completions.with_raw_response.create(
        model=MODEL, prompt="hello", max_tokens=30, extra_body=reader
    )
    assert first.parse().usage.completion_tokens == 30
    fields = _fields(first.headers)
    check_draft_fields(fields)
    day = f"{READER}".encode()
    assert fields[b"ratelimit-policy"] == (
        b'output;q=40;w=1;qu="output-tokens", '
        b"output-day;q=" + day + b';w=86400;qu="output-tokens", '
        b'prompt-hour;q=5000;w=3600;qu="prompt-tokens"'
    )
    assert fields[b"x-ratelimit-limit-tokens-day"] == day
    assert fields[b"x-ratelimit-remaining-tokens-day"] == day  # nothing counted yet
    assert fields[b"x-ratelimit-limit-input-tokens-hour"] == b"5000"
    remaining = {name: int(r.split(";t=")[0]) for name, r in (
        item.split(";r=") for item in fields[b"ratelimit"].decode().split(", "))}  # fmt: skip
    assert remaining == {"output-day": READER, "prompt-hour": 5000}

    used = _until_saved(server, "quota-reader", 30)  # all of the first request
    time.sleep(2 * READ_INTERVAL_S)  # the API server has read that save
    prompt_used = _used(server, "quota-reader", "prompt/hour")  # the first prompt
    before = time.time()
    streamed = api.completions.with_raw_response.create(
        model=MODEL, prompt="hello", max_tokens=5, stream=True, extra_body=reader
    )
    head = _fields(streamed.headers)  # sent before the first token
    after = time.time()
    assert sum(1 for _ in streamed.parse()) >= 1
    check_draft_fields(head)
    left = int(head[b"x-ratelimit-remaining-tokens-day"])
    print(f"\nquota-reader: {used} counted, {left} of {READER} left in the header")
    assert used == 30 and left == READER - used
    assert f"output-day;r={left};t=".encode() in head[b"ratelimit"]
    prompt_left = int(head[b"x-ratelimit-remaining-input-tokens-hour"])
    assert prompt_left == 5000 - prompt_used < 5000
    reset = re.fullmatch(
        r"(?:(\d+)h)?(?:(\d+)m)?([\d.]+)s", head[b"x-ratelimit-reset-tokens-day"].decode()
    )
    assert reset is not None, head[b"x-ratelimit-reset-tokens-day"]
    h, m, sec = reset.groups()
    reset_s = int(h or 0) * 3600 + int(m or 0) * 60 + float(sec)
    assert _resets_at_midnight(reset_s, before, after), reset.group(0)


def test_a_spent_quota_is_refused_with_retry_after_to_the_reset(server):
    api = client(server.base_url).with_options(max_retries=0)
    for _ in range(2):
        assert _complete(api, "quota-user", 25).usage.completion_tokens == 25
    before = time.time()
    error, lag_s = _until_refused(api, "quota-user")
    after = time.time()
    print(f"\nquota spent -> first 429 after {lag_s:.2f} s")
    assert error.status_code == 429
    body = error.response.json()["error"]
    assert body["code"] == "insufficient_quota" and body["type"] == "insufficient_quota"
    assert f"{QUOTA} output tokens per day" in body["message"]
    retry = int(error.response.headers["retry-after"])
    assert _resets_at_midnight(retry, before, after), retry
    fields = _fields(error.response.headers)
    check_draft_fields(fields)
    assert fields[b"x-ratelimit-limit-tokens-day"] == str(QUOTA).encode()
    assert fields[b"x-ratelimit-remaining-tokens-day"] == b"0"
    assert fields[b"ratelimit"] == f"output-day;r=0;t={retry}".encode()
    assert _until_saved(server, "quota-user", 2 * 25) >= 2 * 25  # saved every second
    assert _complete(api, "quota-free", 3).usage.completion_tokens == 3  # others go on


def test_a_reloaded_quota_keeps_the_usage_counted(server):
    api = client(server.base_url).with_options(max_retries=0)
    used = _used(server, "quota-user")
    use_policy(server, _policy(QUOTA + 1000))
    time.sleep(0.5)
    assert _complete(api, "quota-user", 2).usage.completion_tokens == 2  # room again
    use_policy(server, _policy(QUOTA))
    time.sleep(0.5)
    _until_refused(api, "quota-user", timeout_s=3)
    # nothing was forgotten (refused at once, the usage being over QUOTA already:
    # maybe before those 2 tokens were saved)
    assert _until_saved(server, "quota-user", used + 2) >= used + 2


def _sample(page: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_the_dashboard_shows_this_servers_quota_usage_and_refusals(server, tmp_path):
    """The engine's quota gauges and the API server's refusals on the real
    /metrics page (quota-user spent and refused above, quota-reader not),
    and the dashboard's refusal and quota panels evaluated by promtool over
    that page's own series: each returns every limit's figure. (The
    dashboard's Prometheus run in test_ops shares budgets through a store,
    which refuses quotas.)"""
    import httpx
    from prometheus_support import binaries, page_series, promtool_expect, without_prometheus
    from test_ops import CONTRACT_NAMES, contract_exprs

    found = binaries()
    if found is None:
        without_prometheus()
    assert found is not None
    deadline = time.monotonic() + 10
    while True:  # the engine publishes every 0.5 s, saves every 1 s
        page = httpx.get(f"{server.root_url}/metrics", timeout=30, trust_env=False).text
        used = _sample(
            page, "outrate_quota_used_tokens", limit="quota-user", kind="output", window="day"
        )
        if used == _used(server, "quota-user") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    day = {"kind": "output", "window": "day"}
    assert used is not None and used == _used(server, "quota-user") >= QUOTA
    assert _sample(page, "outrate_quota_tokens", limit="quota-user", **day) == QUOTA
    assert _sample(page, "outrate_quota_spent_users", limit="quota-user", **day) == 1
    reader = _sample(page, "outrate_quota_used_tokens", limit="quota-reader", **day)
    assert reader is not None and 35 <= reader < READER
    assert _sample(page, "outrate_quota_spent_users", limit="quota-reader", **day) == 0
    refused = _sample(page, "outrate_requests_refused_total", limit="quota-user", reason="quota")
    assert refused is not None and refused >= 2  # one in each test that spent it
    counters = {"outrate_requests_refused_total"}
    series = page_series(page, CONTRACT_NAMES, counters)
    cases = []
    for expr in contract_exprs().values():
        (name,) = CONTRACT_NAMES & set(re.findall(r"outrate_\w+", expr))
        by = re.search(r"by \(([^)]*)\)", expr)
        assert by is not None, expr
        keys = [k.strip() for k in by.group(1).split(",")]
        want: dict[str, float] = {}
        for s in series:
            if not s["series"].startswith(name + "{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', s["series"]))
            key = "{" + ", ".join(f'{k}="{labels[k]}"' for k in keys) + "}"
            step = float(s["values"].removeprefix("0+").partition("x")[0])
            want[key] = want.get(key, 0.0) + (step / 15 if name in counters else step)
        assert want, f"nothing on the page for {expr}"
        cases.append(
            {"expr": expr, "exp_samples": [{"labels": k, "value": v} for k, v in want.items()]}
        )
    promtool_expect(found[1], tmp_path, series, cases)
    print(f"\n{len(cases)} panel queries over {len(series)} series of the page")


def _quota_lines(server, *users: str) -> list[str]:
    """`outrate quota --file` on the server's quota file: its output/day lines of `users`."""
    result = CliRunner().invoke(app, ["quota", "--file", str(server.quota_path)])
    assert result.exit_code == 0, result.stderr
    mine = tuple(f"{u}  output/day  " for u in users)
    return [line for line in result.stdout.splitlines() if line.startswith(mine)]


def test_a_restart_hands_nobody_a_fresh_day(server):
    """Issue 41: the session's `outrate serve` stopped and started again in
    place (same argv, same --outrate-quota-file). quota-user, spent before,
    is refused at its first request after (429 `insufficient_quota`,
    Retry-After to midnight UTC, 0 left); quota-reader, partly used, has
    what was counted before the stop: `outrate quota --file` prints the same
    lines from the new engine's first saves, the first response after says
    `READER - used` left, and the engine counts on from `used`."""
    api = client(server.base_url).with_options(max_retries=0)
    _until_refused(api, "quota-user")  # spent (by the tests above, or now)
    assert _complete(api, "quota-reader", 7).usage.completion_tokens == 7
    wait_idle(server)
    time.sleep(2 * SAVE_INTERVAL_S)  # every request above counted and saved
    used = _used(server, "quota-reader")
    lines = _quota_lines(server, "quota-user", "quota-reader")
    assert len(lines) == 2 and 7 <= used < READER

    began = time.monotonic()
    started = restart(server)
    print(f"\nrestarted in {time.monotonic() - began:.1f} s; quota-reader {used} used")
    deadline = time.monotonic() + 10
    while json.loads(server.quota_path.read_text())["saved"] < started:
        assert time.monotonic() < deadline, "the new engine saved nothing"
        time.sleep(0.1)  # its first save is a second after its start
    assert _quota_lines(server, "quota-user", "quota-reader") == lines
    assert _used(server, "quota-reader") == used

    before = time.time()
    with pytest.raises(openai.RateLimitError) as refused:
        _complete(api, "quota-user", 1)  # its first request since the start
    after = time.time()
    error = refused.value.response
    assert error.json()["error"]["code"] == "insufficient_quota"
    assert _resets_at_midnight(int(error.headers["retry-after"]), before, after)
    assert error.headers["x-ratelimit-remaining-tokens-day"] == "0"

    reader = {"vllm_xargs": {"output_rate_user": "quota-reader"}, "ignore_eos": True}
    first = api.completions.with_raw_response.create(
        model=MODEL, prompt="hello", max_tokens=5, extra_body=reader
    )
    assert first.parse().usage.completion_tokens == 5
    assert int(first.headers["x-ratelimit-remaining-tokens-day"]) == READER - used
    assert _until_saved(server, "quota-reader", used + 5) == used + 5
