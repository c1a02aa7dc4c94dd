"""tests/lanes.py, `make test`'s runner: the shared tail of the paced tests
goes to one lane each, the longest first, and every lane's results count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lanes  # noqa: E402
import shared_tail  # noqa: E402

_MODULE = """
import os, time
def test_one():
    with open(os.environ["LOG"], "a") as f:
        f.write(os.environ["OUTRATE_LANE"] + " " + __name__ + "\\n")
    time.sleep(0.2)
def test_two():
    with open(os.environ["LOG"], "a") as f:
        f.write(os.environ["OUTRATE_LANE"] + " " + __name__ + "\\n")
"""


def test_each_shared_module_runs_in_exactly_one_lane_last_and_in_order(tmp_path: Path) -> None:
    """Three pytest runs at once over the same files, as make test's lanes
    (tests/shared_tail.py): every test of a shared module runs in the one
    lane that claimed it, after that lane's own tests, the modules in the
    list's order; the other lanes neither run nor report it."""
    names = ["test_own", "test_s1", "test_s2", "test_s3", "test_s4"]
    for name in names:
        (tmp_path / f"{name}.py").write_text(_MODULE)
    shared = [f"{n}.py" for n in names[1:]]
    log, claims = tmp_path / "log", tmp_path / "claims"
    runs = {}
    for lane in ("paced", "beside", "waits"):
        env = {
            **os.environ,
            "LOG": str(log),
            "PYTHONPATH": str(Path(__file__).resolve().parent),
            shared_tail.SHARED_ENV: ",".join(shared),
            shared_tail.CLAIMS_ENV: str(claims),
            shared_tail.LANE_ENV: lane,
        }
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "shared_tail", "-p", "no:cacheprovider"]
        argv += ["-m", f"not {shared_tail.MARKER} or {shared_tail.MARKER}"]
        runs[lane] = subprocess.Popen(
            [*argv, "--junitxml", str(tmp_path / f"{lane}.xml")],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    for proc in runs.values():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
    lines = [line.split() for line in log.read_text().splitlines()]
    taken = shared_tail.claimed(claims)
    assert sorted(taken) == names[1:]  # each claimed once
    for lane in runs:
        ran = [module for by, module in lines if by == lane]
        mine = [m for m in names[1:] if taken[m] == lane]
        assert ran == ["test_own", "test_own"] + [m for m in mine for _ in (1, 2)], (lane, ran)
        assert lanes.counts(tmp_path / f"{lane}.xml") == (2 + 2 * len(mine), 0, 0)


def test_the_shared_modules_exist_and_each_is_one_lanes_whole() -> None:
    """A shared module runs in whichever lane claims it, under that lane's
    selection or `shared`: so all its tests must be one lane's, paced
    (end-to-end, not beside) or beside (each end-to-end test marked
    beside), never quiet or waits, nor in the idle lane."""
    root = Path(lanes.REPO)
    for m in lanes.SHARED:
        text = (root / m).read_text()
        assert "mark.quiet" not in text and "mark.waits" not in text, m
        assert m not in lanes.IDLE, m
        paced = "pytest.mark.e2e" in text and "pytest.mark.beside" not in text
        beside = text.count("pytest.mark.e2e") == text.count("pytest.mark.beside")
        assert paced or beside, m


def test_arguments_naming_tests_run_as_given() -> None:
    assert lanes.shared_modules([]) == lanes.SHARED
    assert lanes.shared_modules(["-x", "-k", "store"]) == lanes.SHARED
    assert lanes.shared_modules(["tests/test_e2e_store.py"]) == ()
    assert lanes.shared_modules(["tests/test_e2e.py::test_x", "-x"]) == ()


def test_counts_read_a_lanes_junit_file(tmp_path: Path) -> None:
    xml = tmp_path / "a.xml"
    xml.write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="1" skipped="1"/></testsuites>'
    )
    assert lanes.counts(xml) == (2, 2, 1)
    assert lanes.counts(tmp_path / "missing.xml") == (0, 0, 0)


def test_every_test_is_in_exactly_one_lane_whatever_its_markers() -> None:
    """The lanes' `-m` expressions, evaluated for every combination of the
    markers they read: one lane each (a test in none would never run; in
    two, it would run twice, beside itself)."""
    names = sorted(
        {
            w
            for args in lanes.LANES.values()
            for w in args[1].replace("(", " ").replace(")", " ").split()
        }
        - {"and", "or", "not"}
    )
    assert names == ["beside", "e2e", "quiet", "waits"]
    for bits in range(2 ** len(names)):
        marks = {n: bool(bits >> i & 1) for i, n in enumerate(names)}
        chosen = [lane for lane, args in lanes.LANES.items() if eval(args[1], {}, marks)]
        assert len(chosen) == 1, (marks, chosen)


def test_the_waits_lane_runs_only_modules_that_wait() -> None:
    """A module marked `waits` starts no server: the waits lane runs beside
    the paced one, which holds beside one core's worth of other work only."""
    root = Path(lanes.REPO) / "tests"
    marked = [
        p
        for p in sorted(root.glob("test_*.py"))
        if any(
            line.startswith("pytestmark") and "mark.waits" in line
            for line in p.read_text().splitlines()
        )
    ]
    assert len(marked) >= 5
    for p in marked:
        text = p.read_text()
        assert "ServerProcess" not in text and "session_server" not in text, p.name
        assert "mark.e2e" not in text and "(server)" not in text, p.name


def test_the_idle_lane_runs_beside_modules_that_judge_no_time() -> None:
    """The idle lane's modules exist, belong to the beside lane whole (no
    end-to-end test, no waits), and neither start a server nor read a clock
    to judge: at SCHED_IDLE a module may wait for the CPU a long time."""
    root = Path(lanes.REPO)
    assert lanes.idle_modules([]) == lanes.IDLE
    assert lanes.idle_modules(["tests/test_loader.py"]) == ()
    assert not set(lanes.IDLE) & set(lanes.SHARED)
    for m in lanes.IDLE:
        text = (root / m).read_text()
        assert "mark.e2e" not in text and "mark.waits" not in text and "mark.quiet" not in text, m
        assert "ServerProcess" not in text and "session_server" not in text, m
        assert "monotonic" not in text and "sleep(" not in text, m
        assert "timeout=" not in text.replace("timeout=IDLE_HANG_S", ""), m  # a hang guard only


def test_the_idle_lane_runs_at_sched_idle(tmp_path: Path) -> None:
    out = tmp_path / "policy"
    cmd = [
        sys.executable,
        "-c",
        f"import os; open({str(out)!r}, 'w').write(str(os.sched_getscheduler(0)))",
    ]
    assert lanes.run_lane([cmd], tmp_path / "log", preexec=lanes.lowest_priority) == 0
    assert int(out.read_text()) == os.SCHED_IDLE
