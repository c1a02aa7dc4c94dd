"""tests/lanes.py, `make test`'s runner: the shared tail of the paced tests
goes to one lane each, the longest first, and every lane's results count."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lanes  # noqa: E402


def test_each_shared_module_goes_to_exactly_one_lane_in_order() -> None:
    shared = lanes.Shared(lanes.SHARED)
    got: dict[str, list[str]] = {name: [] for name in lanes.STEALS}
    barrier = threading.Barrier(len(got))

    def lane(name: str) -> None:
        barrier.wait()
        while (m := shared.take(name)) is not None:
            got[name].append(m)

    threads = [threading.Thread(target=lane, args=(n,)) for n in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(m for mods in got.values() for m in mods) == sorted(lanes.SHARED)
    for name, mods in got.items():  # each lane took them in the list's order
        assert mods == [m for m in lanes.SHARED if m in mods]
        assert all(shared.taken[m] == name for m in mods)
    assert shared.take("paced") is None


def test_the_shared_modules_are_paced_end_to_end_tests_that_exist() -> None:
    root = Path(lanes.REPO)
    for m in lanes.SHARED:
        text = (root / m).read_text()
        assert "e2e" in text and "pytest.mark.beside" not in text and "mark.quiet" not in text, m


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
