"""How far a simulation is from what an engine recorded: per user, the
engine's tok/s (from its `--outrate-trace`) beside the simulated one.

`outrate simulate calibrate --workload W --policy P -- FLAGS` prints it for
the calibration run itself (in sample: the least it can be off by); the
out-of-sample test (tests/test_simulate_oos.py) measures the rest. A
trace has no per-request times, so the time to first token is compared
there, from vLLM's per-request metrics, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outrate.observe.trace import engine_rate, user_tokens
from outrate.simulate.report import RunResult


@dataclass(frozen=True)
class UserAgreement:
    user: str
    engine: float
    """tok/s in the trace."""
    simulated: float

    @property
    def error(self) -> float:
        """(simulated - engine) / engine; 0 when the engine shows no rate."""
        return (self.simulated - self.engine) / self.engine if self.engine else 0.0


def rate_agreement(lines: list[dict[str, Any]], run: RunResult) -> list[UserAgreement]:
    """Every simulated user that has tokens in the trace."""
    out = []
    for user, stats in run.users.items():
        real = engine_rate(user_tokens(lines, user))
        if real > 0:
            out.append(UserAgreement(user, real, stats.rate))
    return out


def format_agreement(rows: list[UserAgreement], what: str) -> str:
    worst = max((abs(r.error) for r in rows), default=0.0)
    lines = [f"{what}: tok/s per user, the trace's and simulated (worst {worst:.1%})"]
    lines += [
        f"  {r.user}: {r.engine:.1f} engine, {r.simulated:.1f} simulated ({r.error:+.1%})"
        for r in rows
    ]
    return "\n".join(lines)
