"""A pytest plugin for the end-to-end tests: a dead engine is named.

When a test server's worker dies (a SIGILL in a CPU kernel, the OOM killer),
vLLM answers every later request with "EngineCore encountered an issue", and
each test fails with that. Here a failed test asks the servers it used
(`examples/serverproc.py` `ServerProcess.death`) and puts the answer first: which
process died, of which signal, and the log's path. A test whose fixture
server is already dead fails at once with that line, without sending a request.
Loaded by tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
import serverproc

_FIRST_SERVER = pytest.StashKey[int]()


def servers_of(item: pytest.Item) -> list[serverproc.ServerProcess]:
    """The servers a test used: its fixtures' and those started during it."""
    funcargs = getattr(item, "funcargs", {})
    mine = [v for v in funcargs.values() if isinstance(v, serverproc.ServerProcess)]
    first = item.stash.get(_FIRST_SERVER, len(serverproc.started))
    return mine + [s for s in serverproc.started[first:] if s not in mine]


def deaths(servers: list[serverproc.ServerProcess]) -> list[str]:
    return [death for death in (s.death() for s in servers) if death]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_FIRST_SERVER] = len(serverproc.started)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    said = deaths(servers_of(item))
    if said:
        pytest.fail("engine dead before the test: " + "; ".join(said), pytrace=False)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        said = "; ".join(deaths(servers_of(item)))
        if said:
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None and said not in crash.message:
                crash.message = f"{said} | {crash.message}"
            report.sections.insert(0, ("engine died", said))
    return report
