"""A real redis-server that refuses the engine's store client, with the
fallbacks `local` and `full`: a wrong password, and an ACL user without the
rights outrate needs (no scripts; no access to outrate's keys). And what
`pause` does to a user with a peak while the store is away.

As documented (README, docs/several-engines.md): a store that refuses the
engine at start stops the start, with one clear error, unless the fallback
is `full`, which starts at the full rate, says the store refused (not "is
unreachable"), and joins once the store lets it in. No password reaches a log
line or the error. Run at the store/runner level: no vLLM server."""

from __future__ import annotations

import logging
import time
from urllib.parse import quote

import pytest

pytest.importorskip("redis")

from redis_support import (  # noqa: E402
    PLAIN_PASSWORD,
    SECRET,
    STORE_USER,
    STORE_USER_PASSWORD,
    RedisServer,
)
from shared_support import S, engine, policy, settle  # noqa: E402

from outrate.budget.shared.runner import StoreRefused  # noqa: E402

pytestmark = pytest.mark.waits  # make test's waits lane (tests/lanes.py)

ACL = {
    "no scripts": ["~*", "+@all", "-@scripting"],
    "no keys": ["~someone-else:*", "+@all"],
}
WHY = {
    "wrong password": "AuthenticationError: invalid username-password pair",
    "no scripts": "NoPermissionError: this user has no permissions to run the 'evalsha' command",
    "no keys": "NoPermissionError: this user has no permissions to access one of the keys",
}


@pytest.fixture(params=list(WHY))
def refusing(request, tmp_path):  # type: ignore[no-untyped-def]
    """(what refuses, the server, a URL it refuses): each with a password that
    begins with SECRET, as every password in redis_support does."""
    case = request.param
    rules = {STORE_USER: ACL[case]} if case in ACL else {}
    server = RedisServer(
        tmp_path, password=PLAIN_PASSWORD, users={STORE_USER: STORE_USER_PASSWORD}, acl=rules
    ).start()
    if case == "wrong password":
        url = f"redis://:{SECRET}-wrong@127.0.0.1:{server.port}/0"
    else:
        secret = quote(STORE_USER_PASSWORD, safe="")
        url = f"redis://{STORE_USER}:{secret}@127.0.0.1:{server.port}/0"
    yield case, server, url
    server.stop()


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vllm.outrate"]


def test_local_stops_the_start_with_one_clear_error(refusing, caplog) -> None:  # type: ignore[no-untyped-def]
    case, server, url = refusing
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    with pytest.raises(StoreRefused) as exc:
        engine(url, fallback="local", start=True)
    message = str(exc.value)
    assert f"budget store redis://***@127.0.0.1:{server.port}/0 refused this engine at start" in (
        message
    )
    assert WHY[case] in message
    assert "a configuration error, not an outage" in message
    assert "Fix the URL, the password or the user's rights on the store (ACL)" in message
    assert "pass --outrate-store-fallback full" in message
    # One line, the error: no "unreachable ... enforcing rate/N" before it.
    assert _said(caplog) == [message]
    assert SECRET not in caplog.text and SECRET not in message and STORE_USER not in message


def test_full_starts_at_the_full_rate_and_joins_once_let_in(refusing, caplog) -> None:  # type: ignore[no-untyped-def]
    case, server, url = refusing
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    lim, runner = engine(url, fallback="full", engines_hint=2, start=True, retry_s=0.05)
    try:
        assert runner.up is False and runner.metrics.errors >= 1 and runner.metrics.waiting == 0
        settle(lim)
        b = lim.pin("alice")
        assert lim.limit_of(b, 10 * S).rate == 20  # the full rate, not rate/2
        assert sum(lim.take(b, 10 * S) for _ in range(10)) == 3  # 1 + 100 ms x 20 tok/s
        (first,) = _said(caplog)
        assert first.startswith(
            f"outrate: budget store redis://***@127.0.0.1:{server.port}/0 refused this engine "
            f"at start ({WHY[case]}"
        )
        assert (
            "enforcing the full rate on each engine until it answers, as "
            "--outrate-store-fallback full asks, and retrying; fix the URL" in first
        )
        assert "unreachable" not in first
        time.sleep(0.3)  # retries: counted, not logged again
        assert runner.metrics.errors >= 3 and len(_said(caplog)) == 1
        # The operator mends the store: the engine joins at the next retry.
        admin = server.client()
        if case == "wrong password":
            admin.config_set("requirepass", f"{SECRET}-wrong")
        else:
            admin.execute_command("ACL", "SETUSER", STORE_USER, "~*", "+@all")
        deadline = time.monotonic() + 5
        while not runner.up and time.monotonic() < deadline:
            time.sleep(0.02)
        while "sharing budgets through" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert runner.up and "sharing budgets through" in caplog.text
    finally:
        runner.stop()
    assert SECRET not in caplog.text and STORE_USER not in caplog.text


def test_pause_holds_committed_tokens_but_a_peak_still_borrows(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """Issue 42: with `pause`, alice {rate: 20, peak: 100} got 83-97 tok/s
    while bob (no peak) was held at 0. Kept, deliberately, and documented:
    borrowing is local to each engine (spare capacity no committed request
    there can use, against an excess bucket of its own) and never goes
    through the store, so `pause` holds the committed part alone; the log
    line says so."""
    caplog.set_level(logging.INFO, logger="vllm.outrate")
    text = "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n"
    pol = policy(text + "  alice: {rate: 20, peak: 100}\n  bob: 20\n")
    server = RedisServer(tmp_path)  # never started: the store is away
    lim, runner = engine(server.url, pol, fallback="pause", engines_hint=2)
    try:
        settle(lim)
        alice, bob = lim.pin("alice"), lim.pin("bob")
        now = 10 * S
        assert runner.metrics.waiting == 1
        assert not any(lim.take(alice, now) for _ in range(5))  # committed: held
        assert not any(lim.take(bob, now) for _ in range(5))
        assert not lim.borrow(bob, now)  # no peak, nothing to borrow
        # alice borrows up to peak - rate = 80 tok/s: 1 + 100 ms x 80 at once, 80 a second on
        assert sum(lim.borrow(alice, now) for _ in range(20)) == 9
        second = sum(lim.borrow(alice, now + t * S // 100) for t in range(1, 101) for _ in range(5))
        assert second == 80
        assert "users with a peak still borrow up to peak - rate on this engine" in caplog.text
    finally:
        runner.stop()
