"""The API server's side of `--outrate-store`: request rates (`requests:`)
shared by every API server through the store, as engines share tokens.

Each API-server process leases request credit with a lease thread of its
own (outrate.budget.shared.runner, kind `REQUESTS`) for its `RequestTable`
(outrate.contract.requests), and heartbeats apart from the engines (it is
not an engine: the engines' fallback does not divide by it). Built with the
gate, at app startup, from the settings the process that parsed the flags
handed over (`api`: the store URL without its password, which comes from
`OUTRATE_STORE_PASSWORD` like the engine core's).
"""

from __future__ import annotations

import logging
from typing import Any

from outrate.budget.shared.credit import DEFAULT_FALLBACK, LEASE_INTERVAL_S, SharedBudget
from outrate.budget.shared.lease import API_SERVERS_KEY, REQUESTS, RedisLink
from outrate.budget.shared.peers import HOLD_S
from outrate.budget.shared.runner import TIMEOUT_S, LeaseRunner
from outrate.contract.requests import RequestTable
from outrate.policy.compiler import CompiledPolicy

logger = logging.getLogger("vllm.outrate")


def open_requests(
    api: dict[str, Any], policy: CompiledPolicy, sha: Any = None
) -> tuple[RequestTable, LeaseRunner | None]:
    """The request table, lent by a shared budget when `api` names a store
    (and its lease thread, started: None without a store). `sha()`: the
    sha256 of the policy in force (heartbeaten)."""
    url = api.get("store")
    if not url:
        return RequestTable(), None
    n = int(api.get("store_api_servers") or 1)
    interval_s = float(api.get("store_lease_ms") or LEASE_INTERVAL_S * 1000) / 1000
    fallback = str(api.get("store_fallback") or DEFAULT_FALLBACK)
    budget = SharedBudget(fallback=fallback, engines_hint=n, interval_s=interval_s)
    table = RequestTable(lender=budget, policy=policy)
    runner = LeaseRunner(
        table.table_for(policy),
        budget,
        RedisLink(url, timeout_s=TIMEOUT_S, peers_key=API_SERVERS_KEY),
        policy_sha=sha or (lambda: policy.sha256),
        logger=logger,
        interval_s=interval_s,
        hold_s=float(api.get("store_hold_s") or HOLD_S),
        expected_from=f"N = {n} API server(s) expected",
        kind=REQUESTS,
    )
    runner.start()
    return table, runner
