"""benchmarks/cpu_by_process.py: the CPU a command's subprocesses spent,
charged to the trees below it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import cpu_by_process  # noqa: E402

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"


def test_a_busy_subprocess_is_charged_to_its_tree(capsys):
    code = cpu_by_process.main(["--", "sh", "-c", f"{sys.executable} -c '{BUSY}'; sleep 0.6"])
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0
    found = re.search(r"([\d.]+) s +\d+ trees +other subprocesses", printed)
    assert found is not None and 1.3 <= float(found.group(1)) <= 2.5
    assert cpu_by_process.kind("/x/python -m outrate serve --model m") == "outrate serve"
    assert cpu_by_process.kind("python -m pytest -q -m quiet") == "pytest runs"
