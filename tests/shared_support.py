"""What the shared-budget tests share (test_shared_*.py): a policy, an
"engine" (a Limiter lent by a SharedBudget and its lease thread on a real
redis-server), the scheduler's step boundary, and a scheduler-like loop."""

from __future__ import annotations

import time
from typing import Any

from outrate.budget.limiter import Limiter
from outrate.budget.shared.credit import SharedBudget, credit_of
from outrate.budget.shared.lease import RedisLink
from outrate.budget.shared.runner import LeaseRunner
from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.loader import parse_policy

MS = 1_000_000
S = 1_000_000_000

POLICY = "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: 20\n  bob: 100\n"

BUDGET_KW = ("fallback", "engines_hint")
RUNNER_KW = ("interval_s", "retry_s", "heartbeat_s", "cap", "hold_s", "expected_from")


def policy(text: str = POLICY, sha: str = "sha-a") -> CompiledPolicy:
    return compile_policy(parse_policy(text, "t.yaml"), "t.yaml", sha)


def engine(
    url: str, pol: CompiledPolicy | None = None, name: str = "e1", start: bool = False, **kw: Any
) -> tuple[Limiter, LeaseRunner]:
    """A table lent by a shared budget, and its lease thread (`runner.budget`)."""
    unknown = set(kw) - {*BUDGET_KW, *RUNNER_KW}
    assert not unknown, unknown
    pol = pol or policy()
    budget = SharedBudget(**{k: v for k, v in kw.items() if k in BUDGET_KW})
    lim = Limiter(pol, lender=budget)
    runner = LeaseRunner(
        lim,
        budget,
        RedisLink(url),
        policy_sha=lambda: pol.sha256,
        engine=name,
        **{k: v for k, v in kw.items() if k in RUNNER_KW},
    )
    if start:
        runner.start()
    else:
        runner.connect()  # one synchronous attempt; rounds are driven by the test
    return lim, runner


def settle(lim: Limiter) -> None:
    """What the scheduler does between steps: apply a mode switch, release."""
    lim.cleanup(time.monotonic_ns(), 0)


def held(b: Any) -> int:
    return credit_of(b).held


def record_calls(runner: LeaseRunner) -> list[list[Any]]:
    """The lease calls of every round trip from now on, round by round."""
    sent: list[list[Any]] = []
    stock = runner.link.round_trip

    def recorded(engine: str, calls: Any, *a: Any, **kw: Any) -> Any:
        sent.append(list(calls))
        return stock(engine, calls, *a, **kw)

    runner.link.round_trip = recorded  # type: ignore[method-assign]
    return sent


def greedy(
    lim: Limiter, user: str, until: float, out: list[tuple[int, int]], streams: int = 2
) -> None:
    """A scheduler-like loop: every ~2 ms, take up to one token per stream."""
    b = lim.pin(user)
    while time.monotonic() < until:
        now = time.monotonic_ns()
        k = sum(lim.take(b, now) for _ in range(streams))
        if k:
            out.append((now, k))
        lim.cleanup(now, 4)
        time.sleep(0.002)
    lim.unpin(b)
