"""Test-wide setup: the example scripts (model builder, server harness, load
generator) are importable by tests, which is also how they are kept working."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for extra in (REPO / "examples", REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))


import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# The property tests check properties, not how fast examples are made: on two
# shared cores, a neighbour's load made generation "too slow" and an example
# overrun hypothesis's 200 ms deadline, failing tests whose property held.
settings.register_profile("outrate", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("outrate")

# A failed test whose server's engine died says so (tests/engine_deaths.py);
# each run ends with its seconds per module (tests/durations.py); the simulate
# tests' servers start before any test (tests/sim_servers.py); under make test
# a module of the shared tail runs in the lane that claims it first
# (tests/shared_tail.py).
pytest_plugins = ["engine_deaths", "durations", "pytester", "sim_servers", "shared_tail"]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One `outrate serve` on the tiny model for every end-to-end module."""
    pytest.importorskip("vllm")
    from e2e_support import session_server

    with session_server(tmp_path_factory.mktemp("policy")) as proc:
        yield proc


_PROCESS_ENV = ("OUTRATE_API_SETTINGS", "OUTRATE_IDENTITY_SECRET", "OUTRATE_METRICS_DIR")


@pytest.fixture(autouse=True)
def _no_identity_state_leaks():
    """Tests that run the plugin's startup (`from_cli_args`) set the API
    server's identity settings and metrics directory in this process's
    environment and build its gate (a reloader thread): undo both after each
    test (servers the tests start must not inherit them)."""
    saved = {name: os.environ.get(name) for name in _PROCESS_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    identity = sys.modules.get("vllm_integration.apiserver.identity")
    if identity is not None:
        identity.reset_gate()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server (redis_support.py), one per test module: modules
    reuse user names, so each gets a clean server."""
    from redis_support import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
