"""benchmarks/gpu_check.py, as a smoke run on the tiny model on vLLM's CPU
platform: it starts outrate and stock vLLM, and its table has every row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_gpu_check_prints_its_table_on_cpu() -> None:
    pytest.importorskip("vllm")
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--seconds", "4",
         "--rounds", "1", "--tokens", "32", "--target", "0"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    out = done.stdout
    print(out)
    assert done.returncode == 0, out + done.stderr[-3000:]
    table = out[out.index("outrate gpu_check: vLLM ") :].splitlines()
    rows = [line.split() for line in table if line.startswith("sync ")]
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("user-20-1", "20", "1"),
        ("user-20-4", "20", "4"),
        ("user-100", "100", "1"),
    ]
    # engine tok/s at least 0.95x the steps allowed (the limit, or fewer
    # where the engine's steps were fewer), which are at most the limit
    assert all(r[-1] == "PASS" and float(r[5]) >= 0.95 * float(r[6]) for r in rows)
    assert all(float(r[6]) <= float(r[2]) for r in rows)
    assert any(line.startswith("async      n/a") for line in table)
    assert any(line.startswith("throughput, limits never reached") for line in table)
