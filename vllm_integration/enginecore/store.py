"""The engine core's side of `--outrate-store`: a `Limiter` lent credit by a
`SharedBudget` for the scheduler, and its lease thread, built from the settings the plugin put in
`additional_config["outrate"]` (`store`, `store_fallback`, `store_hold_s`,
`store_engines`). The password never travels in the settings (vLLM hashes
and may print the config): the plugin moves it to the environment variable
`OUTRATE_STORE_PASSWORD` (and a TLS key's to `OUTRATE_STORE_SSL_PASSWORD`),
which the engine-core process inherits.

The scheduler sees only the limiter (a `BudgetStore`); the lease thread is
one of the engine threads (threads.py), started and stopped with them, and
reaches the scheduler through the budget alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from outrate.budget.limiter import Limiter
from outrate.budget.shared.credit import LEASE_INTERVAL_S, SharedBudget
from outrate.budget.shared.lease import RedisLink
from outrate.budget.shared.peers import HOLD_S
from outrate.budget.shared.runner import TIMEOUT_S, LeaseRunner
from outrate.policy.compiler import CompiledPolicy
from vllm_integration.common.settings import EngineSettings

logger = logging.getLogger("vllm.outrate")


class Store:
    """The tables lent by shared budgets (output tokens, and prompt tokens),
    and the thread that keeps their credit topped up."""

    def __init__(self, limiter: Limiter, runner: LeaseRunner, prompts: Limiter) -> None:
        self.limiter = limiter
        self.runner = runner
        self.prompts = prompts
        """The scheduler's prompt table (`prompt:` limits), shared like `limiter`."""

    def start(self, policy_sha: Callable[[], str]) -> None:
        """After `outrate_configure`: heartbeat the policy in force, start leasing."""
        self.runner.policy_sha = policy_sha
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop()


def open_store(policy: CompiledPolicy, settings: EngineSettings, vllm_config: Any) -> Store | None:
    """None without `--outrate-store`: the engine keeps today's `Limiter`."""
    url = settings.store
    if not url:
        return None
    # vLLM resets data_parallel_size to 1 in each non-MoE engine core: the
    # plugin recorded the size asked for (engines_expected reads it).
    n, expected_from = engines_expected(settings)
    interval_s = float(settings.store_lease_ms or LEASE_INTERVAL_S * 1000) / 1000
    budget = SharedBudget(fallback=settings.store_fallback, engines_hint=n, interval_s=interval_s)
    limiter = Limiter(policy, lender=budget)
    # Prompt budgets: a second table, its own budget, the same thread and rounds.
    pbudget = SharedBudget(fallback=settings.store_fallback, engines_hint=n, interval_s=interval_s)
    prompts = Limiter(policy.prompts, lender=pbudget)
    runner = LeaseRunner(
        limiter,
        budget,
        RedisLink(url, timeout_s=TIMEOUT_S),
        policy_sha=lambda: policy.sha256,
        logger=logger,
        interval_s=interval_s,
        hold_s=settings.store_hold_s or HOLD_S,
        expected_from=expected_from,
        prompts=(prompts, pbudget),
    )
    return Store(limiter, runner, prompts)


def engines_expected(settings: EngineSettings) -> tuple[int, str]:
    """What an engine divides each rate by before its store ever answered
    (then the heartbeats say), and where that number came from, for the
    warning it logs if the store is unreachable at start."""
    if settings.store_engines:
        return settings.store_engines, f"N = {settings.store_engines} from --outrate-store-engines"
    if settings.data_parallel_size > 1:
        n = settings.data_parallel_size
        return n, f"N = {n} from --data-parallel-size (no --outrate-store-engines)"
    return 1, (
        "N = 1: neither --outrate-store-engines nor --data-parallel-size says how many "
        "engines share the store; pass --outrate-store-engines"
    )
