"""A budget shared by several engines (`--outrate-store`): local credit
(`credit`), the global GCRA in Redis (`lease`, `scripts`), the lease thread
(`runner`) and what it counts (`metrics`)."""

from outrate.budget.shared.credit import SharedLimiter
from outrate.budget.shared.lease import RedisLink, check_url
from outrate.budget.shared.runner import LeaseRunner

__all__ = ["LeaseRunner", "RedisLink", "SharedLimiter", "check_url"]
