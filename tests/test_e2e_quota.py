"""Token quotas on the session's `outrate serve` (issue 41 item 3): a spent
quota refuses the user's next request with 429 `insufficient_quota` and
Retry-After up to the UTC window's reset, read with the openai client; a
hot reload of the quota keeps the usage already counted; others are not
refused."""

from __future__ import annotations

import calendar
import json
import time

import pytest

pytest.importorskip("vllm")

import openai  # noqa: E402
from e2e_support import POLICY, use_policy, wait_idle  # noqa: E402
from loadgen import client  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

MODEL = "tiny"
QUOTA = 40


def _policy(quota: int) -> str:
    return POLICY + (
        f"  quota-user: {{rate: unlimited, quota: {{output: {quota}/day}}}}\n"
        "  quota-free: {rate: unlimited, quota: {output: 1M/day}}\n"
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


def _used(server, user: str) -> int:
    data = json.loads(server.quota_path.read_text())
    return int(data["users"][user]["output/day"][1])


def test_a_spent_quota_is_refused_with_retry_after_to_the_reset(server):
    api = client(server.base_url).with_options(max_retries=0)
    for _ in range(2):
        assert _complete(api, "quota-user", 25).usage.completion_tokens == 25
    error, lag_s = _until_refused(api, "quota-user")
    print(f"\nquota spent -> first 429 after {lag_s:.2f} s")
    assert error.status_code == 429
    body = error.response.json()["error"]
    assert body["code"] == "insufficient_quota" and body["type"] == "insufficient_quota"
    assert f"{QUOTA} output tokens per day" in body["message"]
    now = time.time()
    midnight = calendar.timegm(time.gmtime(now)[:3] + (0, 0, 0)) + 86400
    retry = int(error.response.headers["retry-after"])
    assert midnight - now - 2 <= retry <= midnight - now + 2
    assert _used(server, "quota-user") >= 2 * 25
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
    assert _used(server, "quota-user") >= used + 2  # nothing was forgotten
