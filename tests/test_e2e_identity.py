"""Trusted identity on a real `outrate serve`, through the official openai client.

On the session's server (tests/e2e_support.py), given this module's policy
by hot reload: it starts with `identity.source: api_key`; the tests switch it to
`on_claim_mismatch: ignore` and then to `source: header` by editing its
policy file, as an operator would, and wait for the API server to apply each
edit (a probe on /tokenize, which passes the same guard and never reaches the
engine). Who was charged is read from the engine's token trace, never from
the client. The last test greps the server log for every key it handed out.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import openai  # noqa: E402
from e2e_support import use_policy as use_session_policy  # noqa: E402
from e2e_support import wait_idle  # noqa: E402
from loadgen import Stream, stream_completion  # noqa: E402
from serverproc import HOST, ServerProcess  # noqa: E402

from outrate.observe.trace import read_trace  # noqa: E402
from outrate.policy.keys import add_key, revoke_keys  # noqa: E402

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny"
CAROL_RATE = 20  # carol's stream lasts a few seconds: long enough to revoke mid-stream

LIMITS = f"""\
version: 1
default: unlimited
anonymous: unlimited
users:
  carol: {CAROL_RATE}
"""
API_KEY_REJECT = LIMITS + "identity:\n  source: api_key\n  keys: keys.yaml\n"
API_KEY_IGNORE = API_KEY_REJECT + "  on_claim_mismatch: ignore\n"
HEADER = "x-outrate-user"
HEADER_IGNORE = (
    LIMITS + f"identity:\n  source: header\n  header: {HEADER}\n  on_claim_mismatch: ignore\n"
)
HEADER_REJECT = HEADER_IGNORE.replace("ignore", "reject")


@pytest.fixture(scope="module")
def server(server):
    """The session's server (tests/e2e_support.py), with this module's
    identity policy and keys file beside its policy; the base policy back
    at the end, applied by the API servers too before the next module."""
    from e2e_support import POLICY

    workdir = server.policy_path.parent
    keys_file = workdir / "keys.yaml"
    keys = {user: add_key(keys_file, user)[0] for user in ("alice", "bob", "carol")}
    log_from = Path(server.log_path).stat().st_size
    wait_idle(server)
    use_session_policy(server, API_KEY_REJECT)
    server.policy = server.policy_path
    server.keys_file = keys_file
    server.keys = keys
    server.trace = server.trace_path
    server.policy_text = API_KEY_REJECT
    server.log_from = log_from
    wait_until(lambda: tokenize(server, []) == 401, "the API server asks for a key")
    yield server
    use_session_policy(server, POLICY)
    wait_until(lambda: tokenize(server, []) == 200, "the API server takes the body's id")
    keys_file.unlink()
    for name in ("policy", "keys_file", "keys", "trace", "policy_text", "log_from"):
        delattr(server, name)


def api(server: ServerProcess, key: str = "none", **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url, api_key=key, max_retries=0, timeout=120,
        default_headers=headers or None,
    )  # fmt: skip


def complete(client: openai.OpenAI, tokens: int = 4, claim: str | None = None) -> int:
    extra = {"ignore_eos": True}
    if claim is not None:
        extra["vllm_xargs"] = {"output_rate_user": claim}
    answer = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=tokens, extra_body=extra
    )
    return answer.usage.completion_tokens


def raw(
    server: ServerProcess, method: str, path: str, body: bytes = b"",
    headers: list[tuple[str, bytes]] | None = None,
) -> tuple[int, dict | str]:  # fmt: skip
    """One request with exactly these headers (http.client sends bytes as given)."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        for name, value in headers or []:
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        text = response.read().decode("utf-8", "replace")
    finally:
        conn.close()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, text


def bearer(key: str) -> list[tuple[str, bytes]]:
    return [("Authorization", f"Bearer {key}".encode())]


def tokenize(server: ServerProcess, headers: list[tuple[str, bytes]], claim: str | None = None):
    """A probe through the guard that never reaches the engine."""
    body: dict = {"model": MODEL, "prompt": "x"}
    if claim is not None:
        body["vllm_xargs"] = {"output_rate_user": claim}
    return raw(server, "POST", "/tokenize", json.dumps(body).encode(), headers)[0]


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 15) -> float:
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - began


def use_policy(server: ServerProcess, text: str, applied: Callable[[], bool]) -> None:
    """Edit the live policy (write and rename) and wait until the API server
    applies it; then give the engine's own reloader the same debounce."""
    if server.policy_text != text:
        tmp = server.policy.with_name(".policy.next")
        tmp.write_text(text)
        os.replace(tmp, server.policy)
        server.policy_text = text
    wait_until(applied, f"the API server applies:\n{text}")
    time.sleep(0.3)


def charged(server: ServerProcess, since_ns: int) -> dict[str, int]:
    """Tokens per user the engine charged since `since_ns` (its trace is
    written every 100 ms)."""
    time.sleep(0.3)
    out: dict[str, int] = {}
    for line in read_trace(server.trace):
        if "step" in line and line["t"] >= since_ns:
            for user, n in line.get("charged", {}).items():
                out[user] = out.get(user, 0) + n
    return out


# -- api_key -------------------------------------------------------------------------


def test_no_key_and_a_wrong_key_get_401_in_openais_error_format(server) -> None:
    status, answer = raw(server, "POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}')
    assert status == 401
    assert answer == {
        "error": {
            "message": "missing API key: send 'Authorization: Bearer <key>'",
            "type": "Unauthorized",
            "param": None,
            "code": 401,
        }
    }
    for key in ("ork_not-a-key", server.keys["alice"][:-1]):
        with pytest.raises(openai.AuthenticationError) as exc:
            complete(api(server, key))
        assert exc.value.status_code == 401
        assert exc.value.body["message"] == "invalid API key"
    with pytest.raises(openai.AuthenticationError):
        api(server, "ork_not-a-key").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.AuthenticationError):
        api(server, "ork_not-a-key").responses.create(model=MODEL, input="hi", max_output_tokens=2)
    # probes and metadata stay open
    for path in ("/health", "/metrics", "/v1/models"):
        assert raw(server, "GET", path)[0] == 200, path


MALFORMED: dict[str, list[tuple[str, bytes]]] = {
    "empty": [("Authorization", b"")],
    "scheme only": [("Authorization", b"Bearer")],
    "wrong scheme": [("Authorization", b"Basic YWxpY2U6c2VjcmV0")],
    "no scheme": [("Authorization", b"ork_alice")],
    "10 KB": [("Authorization", b"Bearer " + b"k" * 10_240)],
    "not ASCII": [("Authorization", "Bearer ключ".encode())],
    "twice": [("Authorization", b"Bearer ork_a"), ("Authorization", b"Bearer ork_b")],
}
GUARDED = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
           "/invocations", "/tokenize", "/v1/route-added-later"]  # fmt: skip


def test_malformed_authorization_headers_get_401_never_500(server) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "messages": [], "input": "hi"}).encode()
    seen = {}
    for case, headers in MALFORMED.items():
        for path in GUARDED:
            status, answer = raw(server, "POST", path, body, headers)
            seen[(case, path)] = status
            assert status == 401, (case, path, answer)
    # Control bytes never reach the app: the HTTP server refuses the request itself.
    status, answer = raw(server, "POST", GUARDED[0], body, [("Authorization", b"Bearer \x01")])
    assert (status, answer) == (400, "Invalid HTTP request received.")
    print(f"\nmalformed Authorization: {len(seen)} requests ({len(MALFORMED)} kinds x "
          f"{len(GUARDED)} routes), all 401")  # fmt: skip


def test_a_key_claiming_another_user_is_403_with_reject_and_charged_as_its_owner_with_ignore(
    server,
) -> None:
    alice = api(server, server.keys["alice"])
    use_policy(
        server,
        API_KEY_REJECT,
        lambda: tokenize(server, bearer(server.keys["alice"]), claim="bob") == 403,
    )
    since = time.monotonic_ns()
    with pytest.raises(openai.PermissionDeniedError) as exc:
        complete(alice, claim="bob")
    assert exc.value.status_code == 403
    assert exc.value.body["message"] == (
        "vllm_xargs.output_rate_user names 'bob', not the user this API key identifies; "
        "leave it out (identity.on_claim_mismatch: reject)"
    )
    with pytest.raises(openai.PermissionDeniedError):
        alice.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"vllm_xargs": {"output_rate_user": "bob"}},
        )  # fmt: skip
    assert complete(alice, 5) == 5
    assert complete(alice, 3, claim="alice") == 3  # naming oneself is fine
    assert charged(server, since) == {"alice": 8}

    use_policy(
        server,
        API_KEY_IGNORE,
        lambda: tokenize(server, bearer(server.keys["alice"]), claim="bob") == 200,
    )
    since = time.monotonic_ns()
    assert complete(alice, 6, claim="bob") == 6
    chat = alice.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"ignore_eos": True, "vllm_xargs": {"output_rate_user": "bob"}},
    )  # fmt: skip
    assert chat.usage.completion_tokens == 4
    response = alice.responses.create(
        model=MODEL, input="hi", max_output_tokens=3,
        extra_body={"vllm_xargs": {"output_rate_user": "bob"}},
    )  # fmt: skip
    assert complete(api(server, server.keys["bob"]), 2) == 2
    expected_alice = 6 + 4 + response.usage.output_tokens
    assert charged(server, since) == {"alice": expected_alice, "bob": 2}


def test_a_revoked_key_gets_401_within_2_s_and_its_streams_finish(server) -> None:
    tokens = 60  # 3 s at carol's 20 tok/s
    carol = server.keys["carol"]
    run = Stream("carol", tokens)
    worker = threading.Thread(
        target=stream_completion, args=(api(server, carol), None, tokens),
        kwargs={"stream": run}, daemon=True,
    )  # fmt: skip
    since = time.monotonic_ns()
    worker.start()
    wait_until(lambda: len(run.token_times) >= 5, "carol's first tokens", 60)
    assert tokenize(server, bearer(carol)) == 200
    revoke_keys(server.keys_file, "carol")
    latency = wait_until(lambda: tokenize(server, bearer(carol)) == 401, "carol refused", 2.0)
    with pytest.raises(openai.AuthenticationError):
        complete(api(server, carol))
    left = tokens - len(run.token_times)
    worker.join(timeout=60)
    assert run.error is None and run.completion_tokens == tokens and run.finish_reason == "length"
    assert charged(server, since) == {"carol": tokens}
    assert complete(api(server, server.keys["alice"]), 1) == 1  # other keys unaffected
    print(
        f"\nrevocation: 401 {latency * 1000:.0f} ms after the keys file was rewritten; "
        f"carol's in-flight stream had {left} of {tokens} tokens to go and finished them"
    )
    assert latency <= 2.0


# -- header --------------------------------------------------------------------------


def test_in_header_mode_a_spoofed_body_claim_never_changes_who_is_charged(server) -> None:
    use_policy(server, HEADER_IGNORE, lambda: tokenize(server, [], claim="eve") == 200)
    since = time.monotonic_ns()
    dave = api(server, **{HEADER: "dave"})
    assert complete(dave, 5, claim="eve") == 5
    chat = dave.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_body={"ignore_eos": True, "vllm_xargs": {"output_rate_user": "eve"}},
    )  # fmt: skip
    assert chat.usage.completion_tokens == 3
    assert complete(api(server), 4, claim="eve") == 4  # no header: anonymous
    # an API key means nothing in header mode, and a body claim is not an identity
    assert complete(api(server, server.keys["alice"]), 2, claim="alice") == 2
    assert charged(server, since) == {"dave": 8, "__anonymous__": 6}

    status, answer = raw(
        server, "POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}',
        [(HEADER, b"a\x1bb")],
    )  # fmt: skip
    assert status == 400
    use_policy(server, HEADER_REJECT, lambda: tokenize(server, [], claim="eve") == 403)
    with pytest.raises(openai.PermissionDeniedError):
        complete(dave, 2, claim="eve")
    with pytest.raises(openai.PermissionDeniedError):
        complete(api(server), 2, claim="eve")  # a claim without the header: a spoof
    since = time.monotonic_ns()
    assert complete(dave, 2, claim="dave") == 2
    assert charged(server, since) == {"dave": 2}


def test_whitespace_around_an_id_never_makes_a_new_user(server) -> None:
    """uvicorn's httptools parser keeps a header's trailing whitespace: `carol   `
    was charged as a new, unlimited user. Spaces and tabs around a header value
    are dropped (RFC 9110 section 5.5); any whitespace left at an end (NBSP), or
    at an end of a body's id, is a 400 naming the field."""
    use_policy(server, HEADER_REJECT, lambda: tokenize(server, [], claim="eve") == 403)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    since = time.monotonic_ns()
    for sent in (b"carol   ", b"carol \t", b"  carol"):
        status, answer = raw(server, "POST", "/v1/completions", json.dumps(body).encode(),
                             [(HEADER, sent)])  # fmt: skip
        assert status == 200, (sent, answer)
        assert answer["usage"]["completion_tokens"] == 3
    assert charged(server, since) == {"carol": 9}  # carol's budget, at carol's 20 tok/s

    nbsp = "carol\u00a0"
    status, answer = raw(server, "POST", "/v1/completions", json.dumps(body).encode(),
                         [(HEADER, nbsp.encode())])  # fmt: skip
    field = f"header {HEADER}"
    assert (status, answer["error"]["message"], answer["error"]["param"]) == (
        400, f"{field} must not begin or end with whitespace (U+00A0 at index 5) "
        f"(parameter={field})", field,
    )  # fmt: skip
    claimed = json.dumps({**body, "vllm_xargs": {"output_rate_user": nbsp}}).encode()
    x = "vllm_xargs.output_rate_user"
    expected = (
        400, f"{x} must not begin or end with whitespace (U+00A0 at index 5) (parameter={x})", x,
    )  # fmt: skip
    status, answer = raw(server, "POST", "/v1/completions", claimed, [(HEADER, b"carol")])
    assert (status, answer["error"]["message"], answer["error"]["param"]) == expected
    use_policy(server, LIMITS, lambda: tokenize(server, [], claim="eve") == 200)  # source: body
    status, answer = raw(server, "POST", "/v1/completions", claimed)
    assert (status, answer["error"]["message"], answer["error"]["param"]) == expected
    since = time.monotonic_ns()
    with pytest.raises(openai.BadRequestError):
        complete(api(server), 2, claim="carol ")
    assert complete(api(server), 2, claim="carol") == 2
    assert charged(server, since) == {"carol": 2}


# -- after all of it -----------------------------------------------------------------


def test_keys_never_appear_in_the_server_log(server) -> None:
    """Runs last: every key above was sent, one was revoked, requests were
    logged with their parameters (--enable-log-requests)."""
    with open(server.log_path, "rb") as f:
        f.seek(server.log_from)  # this module's part of the shared server's log
        log = f.read().decode("utf-8", "replace")
    assert "Added request" in log or "Received request" in log  # the log does log requests
    for user, key in server.keys.items():
        assert key not in log, user
        assert key.removeprefix("ork_")[:20] not in log, user
    assert "Traceback" not in log and "Internal Server Error" not in log
