"""`make demo` must keep working: run it for real (it starts its own server)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
@pytest.mark.beside  # limits of 20-100 tok/s; a stall is a gap over 1 s
def test_demo_passes_and_draws_its_plot(tmp_path):
    png = tmp_path / "demo.png"
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    print(run.stdout[-4000:])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    table = [line for line in lines if line.rstrip().endswith("PASS")]
    assert [line.split()[0] for line in table] == ["user-a", "user-b", "user-c", "anonymous"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "server stopped" in run.stdout  # (each PASS is the demo's own check on the trace)
