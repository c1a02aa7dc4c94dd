"""Test-wide setup: the example scripts (model builder, server harness, load
generator) are importable by tests, which is also how they are kept working."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for extra in (REPO / "examples", REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One `outrate serve` on the tiny model for every end-to-end module."""
    pytest.importorskip("vllm")
    from e2e_support import start_server

    proc = start_server(tmp_path_factory)
    yield proc
    proc.stop()
