"""Per-user budgets: the GCRA decision (`gcra`), the in-memory table
(`limiter`), the protocol the scheduler talks to (`store`), and a budget
shared by several engines through Redis (`shared`, imported on its own: it
needs `redis`)."""

from outrate.budget.gcra import Limit, exact_rate, gcra
from outrate.budget.limiter import Bucket, Lender, Limiter, LimitSource, Stats
from outrate.budget.store import BudgetStore

__all__ = [
    "Bucket",
    "BudgetStore",
    "Lender",
    "Limit",
    "LimitSource",
    "Limiter",
    "Stats",
    "exact_rate",
    "gcra",
]
