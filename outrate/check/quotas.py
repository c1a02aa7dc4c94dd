"""The quota configurations the engine refuses (docs/client-contract.md#quotas),
OR121 (no quota file) and OR122 (a store with data parallel), defined here
once as located `Problem`s: `outrate lint` reports them, and both processes
raise them at start and the engine core on reload
(vllm_integration/common/config.py), with the same text. A quota is never
silently ignored.
"""

from __future__ import annotations

from outrate.errors import Problem
from outrate.policy.compiler import CompiledPolicy

QUOTA_NEEDS_FILE = (
    "a quota needs --outrate-quota-file PATH: usage must survive a restart (a restart "
    "must not give anyone a fresh window)"
)
"""OR121: a quota without `--outrate-quota-file`."""
QUOTA_NOT_SHARED = (
    "quotas with --outrate-store and --data-parallel-size above 1 are not built yet: the "
    "engine cores of one server would share one quota file (run one engine per server, "
    "or remove the quota)"
)
"""OR122: a quota beside `--outrate-store` with data parallel. (A quota with a
store and one engine per server is shared: outrate.budget.shared.usage.)"""


def quota_refusals(
    policy: CompiledPolicy, store: bool, quota_file: str | None, data_parallel: int = 1
) -> list[tuple[str, Problem]]:
    """(code, problem) for the policy's first quota when the deployment cannot
    keep it: OR121 without `quota_file` (with a store too: it is the local
    count while the store is away, and the API server's view), else OR122
    with `store` (`--outrate-store`) and `data_parallel` above 1. Located at
    that rule's `quota` (its rule, or the policy's start, when the policy
    was built by hand)."""
    if quota_file and not (store and data_parallel > 1):
        return []
    for lim in policy.all_limits():
        if lim.quotas:
            name = lim.rule.split(" ")[0]  # `users.bob (tiers.free)`: bob's rule
            line, col = _quota_position(policy, name)
            code, message = (
                ("OR122", QUOTA_NOT_SHARED) if quota_file else ("OR121", QUOTA_NEEDS_FILE)
            )
            return [(code, Problem(policy.source, line, col, f"{name}.quota", message))]
    return []


def _quota_position(policy: CompiledPolicy, name: str) -> tuple[int, int]:
    source = policy.policy
    if source is None:
        return 1, 1
    path: tuple[str | int, ...]
    if name.startswith("match["):
        path = ("match", int(name[6 : name.index("]")]))
    else:
        path = tuple(name.split(".", 1))
    return source.position(*path, "quota") or source.position(*path) or (1, 1)
