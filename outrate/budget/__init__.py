"""Per-user budgets: the GCRA decision and the in-memory table (`limiter`),
the protocol the scheduler talks to (`store`), and a budget shared by several
engines through Redis (`shared`, imported on its own: it needs `redis`)."""

from outrate.budget.limiter import Bucket, Limit, Limiter, LimitSource, Stats, exact_rate, gcra
from outrate.budget.store import BudgetStore

__all__ = [
    "Bucket",
    "BudgetStore",
    "Limit",
    "LimitSource",
    "Limiter",
    "Stats",
    "exact_rate",
    "gcra",
]
