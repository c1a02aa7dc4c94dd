"""`make test`'s runner: the suite in two lanes at once, one per core.

The paced lane (`-m "e2e and not beside"`) holds the end-to-end tests that
judge pacing on what an engine recorded: they start real servers one module
after another and run in order, as they always did. The other lane runs
beside them: every test that needs no server (the scheduler on fabricated
outputs, the limiter's properties, the CLI), and the end-to-end tests marked
`beside`, whose judgments hold beside another engine's load (a server that
starts, answers or refuses; limits far under what the tiny model makes). On
two cores that is the second core's work while the first waits on an engine;
the paced tests hold beside a one-core busy loop (docs/development.md, "Test
time").

The paced lane prints as it goes; the other lane's output is kept in a file
and printed when the paced lane ends. Each lane ends with its seconds per
module (tests/durations.py). The last line sums both lanes in the plain
form `N passed, N failed, N skipped`. The exit status is the first non-zero
lane status (pytest's own codes; a lane that selected no test is fine
while the other ran some), else 0.

    python tests/lanes.py [pytest args...]     # what `make test` runs
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LANES = {"beside": ["-m", "not e2e or beside"], "paced": ["-m", "e2e and not beside"]}


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


def main(args: list[str]) -> int:
    out = Path(tempfile.mkdtemp(prefix="outrate-lanes-"))
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {}
    for name, marks in LANES.items():
        cmd = [sys.executable, "-m", "pytest", "-q", *marks, f"--junitxml={out / name}.xml", *args]
        if name == "paced":
            procs[name] = subprocess.Popen(cmd, cwd=REPO)
        else:
            logs[name] = open(out / f"{name}.log", "wb")  # noqa: SIM115 - closed below
            procs[name] = subprocess.Popen(
                cmd, cwd=REPO, stdout=logs[name], stderr=subprocess.STDOUT
            )
    ended: dict[str, float] = {}
    codes: dict[str, int] = {}
    try:
        while len(codes) < len(procs):
            for name, proc in procs.items():
                if name not in codes and proc.poll() is not None:
                    codes[name] = proc.returncode
                    ended[name] = time.monotonic() - started
            time.sleep(0.5)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
    for name, log in logs.items():
        log.close()
        print(f"\n===== lane {name} ({' '.join(LANES[name])}), its output =====", flush=True)
        sys.stdout.write((out / f"{name}.log").read_text(errors="replace"))
    print()
    passed = failed = skipped = 0
    for name in procs:
        p, f, s = counts(out / f"{name}.xml")
        passed, failed, skipped = passed + p, failed + f, skipped + s
        print(f"lane {name}: exit {codes[name]}, {ended[name]:.0f} s, {p} passed, {f} failed")
    print(f"both lanes: {time.monotonic() - started:.0f} s")
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    # 5 is pytest's "no tests collected": fine for one lane of a selection
    # (`make test ARGS=tests/test_limiter.py`), not for both.
    bad = [c for c in codes.values() if c not in (0, 5)]
    if bad:
        return bad[0]
    return 5 if all(c == 5 for c in codes.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
