"""A pytest plugin for `make test`'s shared tail (tests/lanes.py SHARED): the
modules that start servers of their own run in whichever lane is free first,
inside that lane's own pytest run.

tests/lanes.py names the modules, longest first, in OUTRATE_SHARED, and a
directory for claims in OUTRATE_SHARED_CLAIMS; the lanes that take them
select them too (`-m "... or shared"`). Here their tests get the `shared`
marker and go last, in that order. A lane runs a module only if it is the
first to claim it (a file created in that directory, holding the lane's
name, OUTRATE_LANE) when it reaches the module's first test; the other
lanes pass over its tests without running or reporting them. So each runs
in exactly one lane, and no module pays a pytest start and collection of
its own (~8 CPU seconds each: vLLM's import, the support modules').
Without OUTRATE_SHARED nothing changes. Loaded by tests/conftest.py.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

SHARED_ENV = "OUTRATE_SHARED"
CLAIMS_ENV = "OUTRATE_SHARED_CLAIMS"
LANE_ENV = "OUTRATE_LANE"
MARKER = "shared"

_mine: dict[str, bool] = {}
"""Each shared module this run reached: claimed by this lane or not."""


@functools.cache
def shared() -> tuple[str, ...]:
    """The shared modules (paths relative to the repository), in order: read
    once, not per test (the environment is the lane's, fixed at its start)."""
    return tuple(m for m in os.environ.get(SHARED_ENV, "").split(",") if m)


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def claim(claims: Path, module: str, lane: str) -> bool:
    """True if this lane is the first to claim `module` in `claims`."""
    try:
        fd = os.open(claims / Path(module).stem, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(lane)
    return True


def claimed(claims: Path) -> dict[str, str]:
    """Module name -> the lane that ran it (after a run)."""
    return {p.name: p.read_text() for p in sorted(claims.iterdir())} if claims.is_dir() else {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: the shared tail of make test (tests/shared_tail.py)"
    )


def pytest_itemcollected(item: pytest.Item) -> None:
    if module_of(item) in shared():
        item.add_marker(MARKER)  # before `-m` selects


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {m: i for i, m in enumerate(shared())}
    if order:
        items.sort(key=lambda item: order.get(module_of(item), -1))  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> bool | None:
    module = module_of(item)
    if module not in shared():
        return None
    if module not in _mine:
        claims = Path(os.environ[CLAIMS_ENV])
        claims.mkdir(parents=True, exist_ok=True)
        _mine[module] = claim(claims, module, os.environ.get(LANE_ENV, "?"))
    return None if _mine[module] else True  # True: handled here (another lane runs it)
