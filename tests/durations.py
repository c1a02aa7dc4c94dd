"""A pytest plugin: wall time and CPU time per test module, printed at the
end of a run.

`make test` prints it for each lane (tests/lanes.py), so a module that grows
shows up in the next run's table; docs/development.md keeps the budget each
module must fit. A module's wall time is the sum of its tests' setup, call and
teardown: a server fixture's start counts against the first module that asks
for it, and its stop against the last.

Its CPU time is what this pytest process and every process under it used
from the module's first test to the next module's (or the run's end): the
servers it starts, the subprocesses it runs, and whatever else of the lane's
runs meanwhile (a session server, the quiet lane's servers). The lanes share
two cores, so a run's length follows its CPU seconds more than its wall
seconds: the column says which modules the machine spends itself on.
Loaded by tests/conftest.py.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
from serverproc import descendants, orphaned_cpu_s, spent_cpu_s

SHOWN = 15
_seconds: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)
_running: list[tuple[str, float]] = []
"""The module now running and tree_cpu() when it began (none before the first test)."""


def tree_cpu() -> float:
    """CPU seconds of this process and its descendants, alive or reaped
    (each live one's own and its reaped children's: a zombie's are still
    its own), and what stopped servers' orphans used (`orphaned_cpu_s`)."""
    pids = (os.getpid(), *descendants(os.getpid()))
    return sum(spent_cpu_s(pid) for pid in pids) + orphaned_cpu_s()


def _close(now: float) -> None:
    if _running:
        module, began = _running.pop()
        _cpu[module] += now - began


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    module = item.nodeid.split("::", 1)[0]
    if not _running or _running[0][0] != module:
        now = tree_cpu()
        _close(now)
        _running.append((module, now))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] += report.duration
    _tests[module].add(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    _close(tree_cpu())
    rows = sorted(_seconds.items(), key=lambda kv: kv[1], reverse=True)
    total = sum(_seconds.values())
    terminalreporter.section("seconds per module")
    terminalreporter.write_line("    wall       CPU  tests  module")
    for module, seconds in rows[:SHOWN]:
        terminalreporter.write_line(
            f"{seconds:6.1f} s  {_cpu[module]:6.1f} s  {len(_tests[module]):5d}  {module}"
        )
    rest = rows[SHOWN:]
    if rest:
        terminalreporter.write_line(
            f"{sum(s for _, s in rest):6.1f} s  {sum(_cpu[m] for m, _ in rest):6.1f} s  "
            f"{sum(len(_tests[m]) for m, _ in rest):5d}  the other {len(rest)} modules"
        )
    terminalreporter.write_line(
        f"{total:6.1f} s  {sum(_cpu.values()):6.1f} s  in tests (wall: setup, call, "
        "teardown; CPU: this process and all under it)"
    )
