"""A budget shared by several engines (`--outrate-store`): the scheduler's
side, a `SharedBudget` lending credit to the `Limiter` (`credit`); the global
GCRA in Redis (`lease`, `scripts`, `url`), reached on one server, a Redis
Cluster or behind Sentinels (`topology` picks among `nodes`, `cluster`, `sentinel`); the lease
thread (`runner`), whom it calls in a round (`turns`), the store's faults
(`faults`), what the other engines' heartbeats say (`peers`) and what it
counts (`metrics`)."""

from outrate.budget.shared.credit import Mode, SharedBudget
from outrate.budget.shared.lease import RedisLink, check_url
from outrate.budget.shared.runner import LeaseRunner

__all__ = ["LeaseRunner", "Mode", "RedisLink", "SharedBudget", "check_url"]
