"""`make test`'s runner: `make lint` and the suite in five lanes started at
once: quiet's tests wait for the other four to end; paced, beside and waits
share a tail of modules; idle runs at the lowest priority.

- **paced** (`-m "e2e and not beside and not quiet"`): the end-to-end tests
  that judge pacing on what an engine recorded. They start real servers one
  module after another and run in order, as they always did; they hold
  beside one core's worth of other work (docs/development.md, "Test time").
- **beside** (`make lint`, then `-m "(not e2e or beside) and not waits and
  not quiet"`): the linters, every test that needs no server (the scheduler
  on fabricated outputs, the limiter's properties, the CLI), and the
  end-to-end tests marked `beside`, whose judgments hold beside another
  engine's load (a server that starts, answers or refuses). The paced lane
  is the longer one, so lint here costs the run no wall time (before, it
  ran first, alone: ~50 s on a fresh clone).
- **waits** (the same selection's modules marked `waits`): the modules that
  mostly wait on real time (a store's timeouts and outages, a lease's
  heartbeat, a policy file's watcher) on a tenth of a core or less, and hold
  beside both cores busy. In the beside lane they kept a core's lane for
  ~165 s of waiting; beside it they take what the other lanes leave idle.
  A module that does more than wait (a server, a scheduler loop run for its
  own sake) does not belong here: it would take from the paced lane's core.
- **shared** (`SHARED`): the paced lane's modules that start servers of
  their own (no session server, no order among them), and test_ops, a
  beside module with a server and a Prometheus of its own, come last in
  the runs of the three lanes that take them (paced, beside, waits), and
  whichever lane reaches them first runs the next of them, in SHARED's
  order, inside its own pytest run (tests/shared_tail.py: a claim per
  module; work stealing, so the lanes end within a module of each other,
  however the machine's speed and lint's cache split the rest). The
  waits lane is free long before the others, and these modules wait on
  real time too (a store's outage, a cluster's failover): two of them
  side by side fill the CPU the lanes left idle. Not when the arguments
  name test files or ids: those run as given.
- **idle** (`IDLE`, the beside selection of those files, at SCHED_IDLE):
  the beside lane's modules that judge nothing about time (vLLM's and
  outrate's CLI in subprocesses, the policy parser, the limiter's
  properties), from the start, on CPU the other lanes leave: the gaps
  while servers start and plays wait, the tail once one lane is left.
  Any other lane's process that wakes takes the core from it at once.
  The quiet lane waits for it too, so its tests still run alone (the
  idle lane ended with or before the others on fresh clones here: 493
  and 545 s, against 516-550). Beside a busy machine it may wait minutes for a core:
  its subprocesses' hang guard is IDLE_HANG_S. Not when the arguments
  name test files or ids: the beside lane runs those.
- **quiet** (`-m quiet -rP`): the simulator against a real engine, judged
  against a step model fitted on this machine moments before: another lane
  beside them moves every step's length (tests/sim_drift.py). Its servers
  start with the other lanes (tests/sim_servers.py); its tests wait until
  all four have ended (the file OUTRATE_QUIET_GATE names appears) and the
  machine reads idle, then run alone. Their printed figures (the step
  model's error on each case, each user's tok/s and first tokens, engine
  and simulated) are shown for the tests that pass too (`-rP`): a run's
  log says what it measured.

The paced lane prints as it goes; the others' output is kept in files and
printed when they end. Each lane ends with its seconds per module
(tests/durations.py); the run ends with how busy the machine's cores were
throughout. The last line sums all lanes in the plain form `N passed, N
failed, N skipped`; before it, the plays the tests played again because
the machine starved them or could not tell (`serverproc.replayed`), passing
or not. The exit status is the first non-zero lane status (a
lane's status is its first command's that failed: lint's or pytest's own; a
lane that selected no test is fine while another ran some), else 0.

    python tests/lanes.py [pytest args...]     # what `make test` runs
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from pathlib import Path

import shared_tail

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from serverproc import REPLAYS_ENV  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LANES: dict[str, list[str]] = {
    "beside": ["-m", "(not e2e or beside) and not waits and not quiet"],
    "waits": ["-m", "waits and (not e2e or beside) and not quiet"],
    "paced": ["-m", "e2e and not beside and not quiet"],
    "quiet": ["-m", "quiet", "-rP"],
}
"""Each lane's marker expression: every test is in exactly one, whatever its
markers (tests/test_lanes.py)."""
BEFORE = {"beside": [os.environ.get("MAKE", "make"), "--no-print-directory", "lint"]}
"""Run in a lane before its tests: the lane's status is the first that failed."""
SHARED = (
    "tests/test_bench_gpu_check.py",
    "tests/test_e2e_store.py",
    "tests/test_e2e_store_outage.py",
    "tests/test_e2e_store_cluster.py",
    "tests/test_e2e_api_servers.py",
    "tests/test_ops.py",
)
"""Modules a lane of STEALS runs once its own tests are done, in this
order (the longest first when it was set, docs/development.md): the paced
ones that start servers of their own, then test_ops (beside; the beside
lane had been the one left running alone). Each is one lane's whole
(tests/test_lanes.py). Today's lengths differ; sorted by them (532108e:
test_e2e_store first), the lanes ended no sooner in its one run (485-538 s)."""
STEALS = ("paced", "beside", "waits")
"""The lanes that take SHARED modules: each selects them too (`or shared`),
and runs those it claims first (tests/shared_tail.py)."""
IDLE = (
    "tests/test_doctor.py",
    "tests/test_plugin.py",
    "tests/test_compat.py",
    "tests/test_simulate_cli.py",
    "tests/test_wheel.py",
    "tests/test_limiter.py",
    "tests/test_loader.py",
)
"""Beside modules that judge nothing about time (vLLM's and outrate's CLI in
subprocesses, parsers, properties) and hold however long the machine keeps
them waiting: they run in the idle lane, not the beside lane."""
IDLE_HANG_S = 1200
"""The hang guard of a subprocess the idle lane's tests run (not a speed
bound): beside a one-core busy loop the lane had no core for minutes, and
`outrate doctor` ran past the 180 s it had."""
IDLE_LANE = "idle"
"""A lane at SCHED_IDLE priority, from the start: it runs only on CPU the
other lanes leave (the gaps while servers start and plays wait, the tail
where one lane is left); a process of another lane that wakes takes the
core from it at once. The quiet lane's tests wait for it too."""
GATED = "quiet"
"""The lane whose tests wait for every other lane to end (sim_servers.GATE_ENV)."""
SHOWN_LIVE = ("paced",)
NO_TESTS = 5  # pytest's exit status when a selection collected nothing


def counts(junit: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) from a lane's JUnit XML; failed counts errors."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return 0, 0, 0
    suites = [root] if root.tag == "testsuite" else list(root)
    total = failed = skipped = 0
    for s in suites:
        total += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return total - failed - skipped, failed, skipped


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds busy, CPU seconds in all) over every core since boot,
    from /proc/stat: what a run used of what the machine had."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / hz, sum(fields) / hz


def run_lane(
    cmds: Iterable[list[str]],
    log: Path | None,
    env: dict[str, str] | None = None,
    preexec: Callable[[], None] | None = None,
) -> int:
    """The lane's commands one after the other, whatever each returns; the
    first non-zero status, else 0 (pytest's NO_TESTS included)."""
    status = 0
    for cmd in cmds:
        if log is None:
            code = subprocess.call(cmd, cwd=REPO, env=env, preexec_fn=preexec)
        else:
            with open(log, "ab") as out:
                code = subprocess.call(
                    cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                    preexec_fn=preexec,
                )  # fmt: skip
        if status == 0 or (status == NO_TESTS and code not in (0, NO_TESTS)):
            status = code
    return status


def shared_modules(args: list[str]) -> tuple[str, ...]:
    """SHARED, unless the pytest arguments name test files or ids: then those
    run as given, in the lanes' own runs (a module named would otherwise
    run once more in a shared run)."""
    named = any((REPO / a.split("::", 1)[0]).exists() for a in args if not a.startswith("-"))
    return () if named else SHARED


def idle_modules(args: list[str]) -> tuple[str, ...]:
    """IDLE, unless the pytest arguments name test files or ids: then the
    beside lane runs what they name."""
    return IDLE if shared_modules(args) else ()


def lowest_priority() -> None:
    """In the child, before exec: SCHED_IDLE (inherited by what it starts)."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def selection(name: str, sharing: bool) -> list[str]:
    """The lane's `-m` arguments: a lane that takes the shared modules
    selects them too (tests/shared_tail.py marks their tests `shared`)."""
    flag, expr, *rest = LANES[name]
    if sharing and name in STEALS:
        expr = f"({expr}) or {shared_tail.MARKER}"
    return [flag, expr, *rest]


def main(args: list[str]) -> int:
    out = Path(tempfile.mkdtemp(prefix="outrate-lanes-"))
    gate = out / "quiet-gate"
    started = time.monotonic()
    busy0, all0 = busy_seconds()
    ended: dict[str, tuple[int, float]] = {}
    idle = idle_modules(args)
    names = [*LANES, IDLE_LANE] if idle else list(LANES)
    logs = {name: out / f"{name}.log" for name in names if name not in SHOWN_LIVE}

    modules = shared_modules(args)
    claims = out / "claims"
    replays = out / "replays"
    base = {**os.environ, REPLAYS_ENV: str(replays)}

    def lane(name: str) -> None:
        pytest = [sys.executable, "-m", "pytest", "-q"]
        junit = f"--junitxml={out / name}.xml"
        if name == IDLE_LANE:
            run = [*pytest, *LANES["beside"], *idle, junit, *args]
            code = run_lane([run], logs[name], dict(base), lowest_priority)
            ended[name] = (code, time.monotonic() - started)
            return
        run = [*pytest, *selection(name, bool(modules)), junit, *args]
        if name == "beside":
            run += [f"--ignore={m}" for m in idle]
        cmds = [BEFORE[name], run] if name in BEFORE else [run]
        env = dict(base)
        if name == GATED:
            env["OUTRATE_QUIET_GATE"] = str(gate)
        if modules and name in STEALS:
            env[shared_tail.SHARED_ENV] = ",".join(modules)
            env[shared_tail.CLAIMS_ENV] = str(claims)
            env[shared_tail.LANE_ENV] = name
        ended[name] = (run_lane(cmds, logs.get(name), env), time.monotonic() - started)

    threads = {name: threading.Thread(target=lane, args=(name,)) for name in names}
    for t in threads.values():
        t.start()
    for name, t in threads.items():
        if name != GATED:
            t.join()
            show(name, logs.get(name))
    gate.touch()
    opened = time.monotonic() - started
    threads[GATED].join()
    show(GATED, logs.get(GATED))
    print()
    passed = failed = skipped = 0
    taken = shared_tail.claimed(claims)
    for name, (code, seconds) in ended.items():
        p, f, s = counts(out / f"{name}.xml")
        passed, failed, skipped = passed + p, failed + f, skipped + s
        alone = f" ({seconds - opened:.0f} s alone, after the others)" if name == GATED else ""
        took = [m for m, by in taken.items() if by == name]
        also = f" (with {', '.join(took)})" if took else ""
        print(f"lane {name}: exit {code}, {seconds:.0f} s{alone}, {p} passed, {f} failed{also}")
    played = replays.read_text().splitlines() if replays.exists() else []
    print(f"plays played again (serverproc.replayed): {len(played)}")
    for line in played:
        print(f"  {line}")
    busy1, all1 = busy_seconds()
    print(
        f"all lanes: {time.monotonic() - started:.0f} s; the machine's {os.cpu_count()} "
        f"cores were busy {busy1 - busy0:.0f} of {all1 - all0:.0f} CPU seconds "
        f"({(busy1 - busy0) / max(all1 - all0, 1e-9):.0%}): more lanes cannot help "
        "a run near 100%"
    )
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    codes = [code for code, _ in ended.values()]
    bad = [c for c in codes if c not in (0, NO_TESTS)]
    if bad:
        return bad[0]
    return NO_TESTS if all(c == NO_TESTS for c in codes) else 0


def show(name: str, log: Path | None) -> None:
    """A lane's kept output, once it ended (nothing for a lane shown live)."""
    if log is None:
        return
    shown = " ".join(BEFORE[name]) + ", then " if name in BEFORE else ""
    args = LANES[name] if name in LANES else [*LANES["beside"], "at SCHED_IDLE:", *IDLE]
    print(f"\n===== lane {name} ({shown}{' '.join(args)}), its output =====", flush=True)
    sys.stdout.write(log.read_text(errors="replace") if log.exists() else "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
