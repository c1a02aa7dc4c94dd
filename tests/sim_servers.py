"""A pytest plugin for the simulate tests against a real engine (marked
`quiet`): their servers start together, after collection and before any
test runs. Under `make test` (tests/lanes.py sets OUTRATE_QUIET_GATE to a
file's path) that is while the other lanes still run: a start measures
nothing, so only the tests wait for the machine to be theirs, until the
file appears and then until the machine reads idle (`_settle`: what the
other lanes' ending left to the kernel). The quiet lane then spends no
time on server starts.

A module opts in with a module-level `SIM_SERVER = SimServer(flags, policy)`
and takes its server from `sim_server(request)`: the tiny model with those
engine flags, the policy (YAML text, or a file), a trace
(`proc.trace_path`, the policy's `proc.policy_path`), vLLM's per-request
metrics, and 3 s of examples/workloads/e2e-agree.yaml played to warm it.
Loaded by tests/conftest.py.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

GATE_ENV = "OUTRATE_QUIET_GATE"
GATE_TIMEOUT_S = 3 * 3600
SETTLE_BUSY = 0.10
"""After the gate, the tests start once two 1 s readings in a row find the
machine's CPUs (every core, all processes and the kernel: /proc/stat)
busy less than this share: the other lanes' processes gone, and what
their ending left to the kernel done. An idle server of this lane reads
~1% here. A load that outlasts SETTLE_MAX_S is not a transient of the
lanes' ending: the tests then start, and the line printed says so."""
SETTLE_MAX_S = 60
REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "examples" / "workloads"
_SERVERS = pytest.StashKey[dict[str, object]]()
_FAILED = pytest.StashKey[BaseException]()


@dataclass(frozen=True)
class SimServer:
    flags: tuple[str, ...]
    """Engine flags beside the tiny model's (serverproc.tiny_model_flags)."""
    policy: str | Path
    """The policy: YAML text, or the path of a policy file."""


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    specs: dict[str, SimServer] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        spec = getattr(module, "SIM_SERVER", None)
        if isinstance(spec, SimServer):
            specs[module.__name__] = spec
    if not specs:
        return
    try:
        session.config.stash[_SERVERS] = _start(session.config, specs)
    except BaseException as e:  # raised by each test that asks (sim_server)
        session.config.stash[_FAILED] = e
    _wait_for_gate()


def sim_server(request: pytest.FixtureRequest):
    """The module's server (started before the tests: see the docstring)."""
    failed = request.config.stash.get(_FAILED, None)
    if failed is not None:
        raise failed
    return request.config.stash[_SERVERS][request.module.__name__]


def server_in(d: Path, spec: SimServer, name: str = "sim"):
    """A quiet module's server (not started) writing its trace, log and
    policy (where given as text) under the directory `d`: also what
    benchmarks/carry_over.py --play starts."""
    from build_tiny_model import build
    from serverproc import ServerProcess, cpu_server_env, outrate_serve_argv, worker_env

    policy = Path(spec.policy) if isinstance(spec.policy, Path) else d / "policy.yaml"
    if not isinstance(spec.policy, Path):
        policy.write_text(spec.policy)
    trace = d / "trace.jsonl"
    argv = outrate_serve_argv(
        build(REPO / "models" / "tiny-llama"), policy, *spec.flags, "--outrate-trace", str(trace),
        "--enable-per-request-metrics",
    )  # fmt: skip
    # vLLM's CPU default, the model in a worker: the layout the step
    # model's terms were found and measured on (docs/simulate.md).
    env = cpu_server_env(worker_env("auto"))
    proc = ServerProcess(argv, env=env, log_path=d / "server.log", name=name)
    proc.policy_path, proc.trace_path = policy, trace
    return proc


def _start(config: pytest.Config, specs: dict[str, SimServer]) -> dict[str, object]:
    from e2e_support import start_together
    from workload_player import Player

    from outrate.simulate.workload import load_workload

    root = Path(tempfile.mkdtemp(prefix="outrate-quiet-"))
    servers = {}
    for name, spec in specs.items():
        d = root / name
        d.mkdir()
        servers[name] = server_in(d, spec, name.rsplit(".", 1)[-1])

    def stop() -> None:
        for proc in servers.values():
            proc.stop()

    config.add_cleanup(stop)
    start_together(list(servers.values()), timeout_s=300)
    warm = load_workload(WORKLOADS / "e2e-agree.yaml").workload
    warm = warm.model_copy(update={"duration": 3_000_000_000})
    for proc in servers.values():
        Player(proc.base_url, warm).play()
    return servers


def _wait_for_gate() -> None:
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return
    began = time.monotonic()
    while not os.path.exists(gate):
        if time.monotonic() - began > GATE_TIMEOUT_S:
            raise pytest.UsageError(f"{GATE_ENV}: {gate} did not appear in {GATE_TIMEOUT_S} s")
        time.sleep(0.5)
    print(f"\nquiet: waited {time.monotonic() - began:.0f} s for the other lanes", flush=True)
    _settle()


def _busy() -> tuple[int, int]:
    """The machine's CPU time so far, busy and all (jiffies, /proc/stat)."""
    with open("/proc/stat") as f:  # user nice system idle iowait irq softirq steal (guest: in user)
        fields = [int(x) for x in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # less idle and iowait


def _settle() -> None:
    """Wait, at most SETTLE_MAX_S, for the machine to be idle (SETTLE_BUSY);
    print what was read."""
    if not os.path.exists("/proc/stat"):
        return
    began, quiet, readings = time.monotonic(), 0, []
    while quiet < 2 and time.monotonic() - began < SETTLE_MAX_S:
        b0, t0 = _busy()
        time.sleep(1)
        b1, t1 = _busy()
        readings.append((b1 - b0) / max(1, t1 - t0))
        quiet = quiet + 1 if readings[-1] < SETTLE_BUSY else 0
    shown = ", ".join(f"{r:.0%}" for r in readings[-8:])
    state = "idle" if quiet >= 2 else f"still busy after {SETTLE_MAX_S} s"
    print(f"quiet: the machine {state} ({len(readings)} readings, the last: {shown})", flush=True)
