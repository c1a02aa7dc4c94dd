"""A pytest plugin: wall time per test module, printed at the end of a run.

`make test` prints it for each lane (tests/lanes.py), so a module that grows
shows up in the next run's table; docs/development.md keeps the budget each
module must fit. A module's time is the sum of its tests' setup, call and
teardown: a server fixture's start counts against the first module that asks
for it, and its stop against the last. Loaded by tests/conftest.py.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

SHOWN = 15
_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] += report.duration
    _tests[module].add(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    rows = sorted(_seconds.items(), key=lambda kv: kv[1], reverse=True)
    total = sum(_seconds.values())
    terminalreporter.section("seconds per module")
    for module, seconds in rows[:SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {len(_tests[module]):4d} tests  {module}")
    rest = rows[SHOWN:]
    if rest:
        terminalreporter.write_line(
            f"{sum(s for _, s in rest):8.1f} s  {sum(len(_tests[m]) for m, _ in rest):4d} tests  "
            f"the other {len(rest)} modules"
        )
    terminalreporter.write_line(f"{total:8.1f} s  in tests (setup, call, teardown)")
