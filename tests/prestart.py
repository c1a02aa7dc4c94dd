"""A pytest plugin: a module's servers start while the module before it runs
(one ahead), not when its first test asks.

A server start is ~22 CPU seconds spread over ~50 s of wall time (three
processes import torch and vLLM one after another), and the paced lane's
tests mostly wait on real time (rates of 20-100 tok/s, seconds of load):
started one module ahead, a start fills that wait instead of adding to it.

A module opts in with a module-level `PRESTART`: a function of a fresh
directory returning a context manager that starts what the module needs
(servers, Redis) on entry and stops it on exit. Its module-scoped fixture
returns `prestarted(request)`: the entered value, waited for if its start
is still running, and exited when the fixture ends. The session's server
(conftest's `server`, every module that takes the fixture) is one more
entry, `SESSION_SERVER`, at the first test that asks for it.

The plan is the lane's own collected tests in run order: the first entry
starts after collection, and each entry taken starts the next. Only one
start is ever ahead of the tests. An entry whose start failed raises in the
fixture that takes it, as the start did there before. Loaded by
tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

Start = Callable[[Path], contextlib.AbstractContextManager[Any]]
SESSION_SERVER = "session server"
_PLAN = pytest.StashKey["Plan"]()


class Entry:
    def __init__(self, key: str, start: Start) -> None:
        self.key, self.start = key, start
        self.thread: threading.Thread | None = None
        self.cm: contextlib.AbstractContextManager[Any] | None = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.exited = False

    def launch(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._enter, name=f"prestart {self.key}")
            self.thread.start()

    def _enter(self) -> None:
        try:
            root = Path(
                tempfile.mkdtemp(prefix=f"outrate-{self.key.rsplit('.', 1)[-1].replace(' ', '-')}-")
            )
            cm = self.start(root.resolve())
            self.value = cm.__enter__()
            self.cm = cm
        except BaseException as e:  # raised in the fixture that takes it
            self.error = e

    def take(self) -> Any:
        self.launch()
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value

    def exit(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.cm is not None and not self.exited:
            self.exited = True
            self.cm.__exit__(None, None, None)


class Plan:
    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.by_key = {e.key: e for e in entries}

    def take(self, key: str, start: Start) -> Any:
        entry = self.by_key.get(key)
        if entry is None:  # not in the plan (asked outside the collected run)
            entry = self.by_key[key] = Entry(key, start)
            self.entries.append(entry)
        i = self.entries.index(entry)
        entry.launch()
        if i + 1 < len(self.entries):
            self.entries[i + 1].launch()  # the next one starts while these tests run
        return entry.take()

    def close(self) -> None:
        for entry in self.entries:
            entry.exit()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    entries: list[Entry] = []
    seen: set[str] = set()
    for item in session.items:
        module = getattr(item, "module", None)
        found: list[tuple[str, Start]] = []
        if SESSION_SERVER not in seen and "server" in getattr(item, "fixturenames", ()):
            found.append((SESSION_SERVER, session_start))
        start = getattr(module, "PRESTART", None)
        if start is not None and module is not None and module.__name__ not in seen:
            found.append((module.__name__, start))
        for key, fn in found:
            seen.add(key)
            entries.append(Entry(key, fn))
    plan = Plan(entries)
    session.config.stash[_PLAN] = plan
    session.config.add_cleanup(plan.close)
    if entries:
        entries[0].launch()


def prestarted(request: pytest.FixtureRequest, key: str | None = None) -> Any:
    """The value of the module's `PRESTART` (or of `key`'s entry), entered
    ahead of time where the plan allowed; exited when the asking fixture
    ends."""
    key = key or request.module.__name__
    start = session_start if key == SESSION_SERVER else request.module.PRESTART
    plan = request.config.stash.get(_PLAN, None)
    if plan is None:
        plan = request.config.stash[_PLAN] = Plan([])
        request.config.add_cleanup(plan.close)
    value = plan.take(key, start)
    request.addfinalizer(plan.by_key[key].exit)
    return value


def session_start(root: Path) -> contextlib.AbstractContextManager[Any]:
    """The session's server (tests/e2e_support.session_server)."""
    from e2e_support import session_server

    return session_server(root)
