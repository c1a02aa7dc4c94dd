"""The request rate and the rate-limit header fields through the API server's
guard (vllm_integration/apiserver/guards.py), without a server: one request
at a time through the ASGI middleware, on a fake clock. The real server's
checks are tests/test_e2e_client_contract.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from test_plugin import RESPONSE_HEADERS, _through_guard  # noqa: E402

from outrate.contract.requests import RequestTable  # noqa: E402
from outrate.identity.core import BODY, IdentityConfig  # noqa: E402
from outrate.policy.compiler import compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402

pytestmark = pytest.mark.vllm

POLICY = """\
version: 1
default: {rate: 20, requests: 2}
anonymous: {rate: 5, requests: 1/min}
users:
  bob: {rate: 100, requests: 50, prompt: 1000}
"""


@pytest.fixture
def policy_gate():
    """Install a policy as this process's gate, its clock stopped (undone by
    conftest)."""
    from vllm_integration.apiserver import identity as module

    def use(text: str, identity: IdentityConfig = BODY):
        compiled = compile_policy(parse_policy(text, "p.yaml"), "p.yaml")
        module._gate = module.Gate(identity, None, policy=compiled)
        module._gate.requests = RequestTable(clock=lambda: 10**9)
        return module._gate

    return use


def _body(user: str | None = None) -> bytes:
    body: dict[str, object] = {"model": "m", "prompt": "hi"}
    if user is not None:
        body["vllm_xargs"] = {"output_rate_user": user}
    return json.dumps(body).encode()


def _fields() -> dict[bytes, bytes]:
    return dict(RESPONSE_HEADERS)


def test_every_response_that_goes_on_carries_the_users_limits(policy_gate):
    policy_gate(POLICY)
    status, _, reached = _through_guard(_body("bob"))
    assert (status, reached) == (200, _body("bob"))
    fields = _fields()
    assert fields[b"ratelimit-policy"] == (
        b'requests;q=50;w=1, output;q=100;w=1;qu="output-tokens", '
        b'prompt;q=1000;w=1;qu="prompt-tokens"'
    )
    assert fields[b"ratelimit"] == b"requests;r=49;t=1"
    assert fields[b"x-ratelimit-limit-tokens"] == b"6000"


def test_over_the_rate_is_429_before_any_route_runs(policy_gate):
    policy_gate(POLICY)
    assert [_through_guard(_body("carol"))[0] for _ in range(2)] == [200, 200]
    status, response, reached = _through_guard(_body("carol"))
    assert (status, reached) == (429, None)
    assert json.loads(response) == {
        "error": {
            "message": "Rate limit reached for requests: at most 2 per second. "
            "Please try again in 0.5s.",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    fields = _fields()
    assert (fields[b"retry-after"], fields[b"retry-after-ms"]) == (b"1", b"500")
    assert fields[b"ratelimit"] == b"requests;r=0;t=1"
    assert fields[b"content-type"] == b"application/json"


def test_no_identity_gets_the_anonymous_rule_never_another_users(policy_gate):
    policy_gate(POLICY)
    assert _through_guard(_body())[0] == 200
    fields = _fields()
    assert fields[b"ratelimit-policy"] == b'requests;q=1;w=60, output;q=5;w=1;qu="output-tokens"'
    assert _through_guard(_body())[0] == 429
    assert _through_guard(b"not json", content_type=b"text/plain")[0] == 429  # anonymous too
    assert _through_guard(_body("bob"))[0] == 200  # bob's own budget


def test_the_gateway_header_names_whose_rate(policy_gate):
    policy_gate(POLICY, IdentityConfig(source="header", header="x-user"))
    for _ in range(50):
        assert _through_guard(_body(), headers=[(b"x-user", b"bob")])[0] == 200
    assert _through_guard(_body(), headers=[(b"x-user", b"bob")])[0] == 429
    assert _through_guard(_body())[0] == 200  # anonymous: its own bucket


def test_anthropic_routes_get_anthropics_429(policy_gate):
    policy_gate(POLICY)
    _through_guard(_body(), "/v1/messages")
    status, response, _ = _through_guard(_body(), "/v1/messages")
    assert status == 429
    assert json.loads(response)["error"]["type"] == "rate_limit_error"
    assert _fields()[b"retry-after"] == b"60"


@pytest.mark.parametrize(
    ("style", "names"),
    [
        ("off", set()),
        ("ietf", {b"ratelimit-policy", b"ratelimit"}),
        ("openai", {b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests",
                    b"x-ratelimit-reset-requests", b"x-ratelimit-limit-tokens"}),
    ],
)  # fmt: skip
def test_the_policy_chooses_the_style(policy_gate, style: str, names: set[bytes]) -> None:
    policy_gate(POLICY + f"headers: {style}\n")
    assert _through_guard(_body("carol"))[0] == 200
    assert set(_fields()) == names


def test_probes_are_neither_counted_nor_labelled(policy_gate):
    policy_gate(POLICY)
    for _ in range(3):
        assert _through_guard(b"", "/health", method="GET")[0] == 200
    assert _fields() == {}


def test_a_request_waits_for_shared_credit_on_its_way(policy_gate):
    """With --outrate-store a user's first request on an API server finds no
    request credit yet (tests/test_shared_requests.py): the table says how
    long until it comes (`pending_ns`), and the guard waits that long and
    asks again, for as long as it is on its way (a late lease round: three
    asks here), instead of refusing."""
    from outrate.contract.requests import Admission

    gate = policy_gate(POLICY)
    asked = []

    class Leasing(RequestTable):
        def admit(self, policy, user, now=None):
            asked.append(user)
            if len(asked) <= 3:  # no credit yet: nothing taken
                return Admission(False, policy.requests.limit_for(user), 0, 1, 0, True, 1_000_000)
            return super().admit(policy, user, now)

    gate.requests = Leasing(clock=lambda: 10**9)
    status, _, reached = _through_guard(_body("dave"))
    assert (status, reached, asked) == (200, _body("dave"), ["dave"] * 4)
    assert isinstance(gate.requests.admit(gate.policy, "dave"), Admission)


def test_a_request_waits_for_credit_at_most_max_wait():
    """Credit that never comes (a store paused, its fallback `pause`): the
    request is asked again each `pending_ns` until `MAX_WAIT_NS` has passed
    on the table's clock since its first ask, then refused as any other."""
    import asyncio

    from outrate.contract.requests import MAX_WAIT_NS, admit_waiting

    clock = [10**9]
    policy = compile_policy(parse_policy(POLICY, "p.yaml"), "p.yaml")

    class Never(RequestTable):
        def admit(self, policy, user, now=None):
            a = super().admit(policy, user, now)
            return a._replace(admitted=False, pending_ns=5_000_000, retry_after_ns=5_000_000)

    async def sleep(seconds: float) -> None:
        clock[0] += round(seconds * 1e9)

    table = Never(clock=lambda: clock[0])
    a = asyncio.run(admit_waiting(table, policy, "dave", sleep))
    assert not a.admitted and a.retry_after_ns == 5_000_000
    assert clock[0] - 10**9 == MAX_WAIT_NS  # 400 waits of 5 ms, then no more


@pytest.mark.parametrize(
    ("path", "error"),
    [("/v1/completions", "insufficient_quota"), ("/v1/messages", "rate_limit_error")],
)
def test_a_spent_quota_is_refused_in_the_routes_shape(policy_gate, tmp_path, path, error):
    """A user whose quota the engine's file says is spent gets a 429 before
    any route runs: OpenAI's `insufficient_quota`, Anthropic's
    `rate_limit_error` on `/v1/messages`, the message naming the quota, and
    Retry-After up to the window's reset."""
    from outrate.budget.quota import window_bounds
    from outrate.contract.quotas import QuotaView

    now = 1_700_000_000.0
    start, end = window_bounds("day", now)
    usage = tmp_path / "quota.json"
    usage.write_text(json.dumps({"version": 1, "users": {"eve": {"output/day": [start, 12]}}}))
    gate = policy_gate(POLICY + "  eve: {rate: 100, quota: {output: 10/day}}\n")
    gate.quotas = QuotaView(str(usage), clock=lambda: now)
    status, response, reached = _through_guard(_body("eve"), path)
    assert (status, reached) == (429, None)
    body = json.loads(response)
    assert body["error"]["type" if error == "rate_limit_error" else "code"] == error
    assert "quota" in body["error"]["message"]
    assert int(_fields()[b"retry-after"]) == end - int(now)
    assert _through_guard(_body("bob"), path)[0] == 200  # bob has no quota
