"""benchmarks/cpu_by_process.py: the CPU a command's subprocesses spent,
charged to the trees below it."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import cpu_by_process  # noqa: E402

BUSY = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass\n"
    "time.sleep(1.5)"
)
"""1.5 CPU seconds, then alive long enough for a sample to see all of them
(what a process spends after its last sample is missed: up to 0.5 s)."""


def test_a_busy_subprocess_is_charged_to_its_tree(capsys):
    code = cpu_by_process.main(["--", "sh", "-c", f"{sys.executable} -c '{BUSY}'"])
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0
    found = re.search(r"([\d.]+) s +\d+ trees +other subprocesses", printed)
    assert found is not None and 1.3 <= float(found.group(1)) <= 2.5
    assert cpu_by_process.kind("/x/python -m outrate serve --model m") == "outrate serve"
    assert cpu_by_process.kind("python -m pytest -q -m quiet") == "pytest runs"


def test_another_jobs_process_is_not_charged(capsys):
    """A busy process started beside the command (by this test, as another
    test lane starts its own under `make test`) is not the command's: under
    a loaded `make test` it was charged, 3.0 s where 1.5 were the command's."""
    beside: list[subprocess.Popen] = []
    timer = threading.Timer(
        0.6, lambda: beside.append(subprocess.Popen([sys.executable, "-c", BUSY]))
    )
    timer.start()
    try:
        code = cpu_by_process.main(["--", "sh", "-c", "sleep 4"])
    finally:
        timer.join()
        for p in beside:
            p.wait()
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0 and beside
    assert float(re.search(r"processes started: ([\d.]+)", printed).group(1)) < 0.5
