"""The wheel a user installs: built from this checkout, installed (not
editable) into a fresh venv beside the vLLM under test, and run from outside
the checkout, so nothing can come from the source tree.

Checks what the README promises a GPU user who installs it that way:
`outrate lint` works, the plugin registers (vLLM's serve parser lists the
outrate flags), and every module and data file of the two packages is in the
wheel (a file missing from `packages.find` or `package-data` would fail only
on a user's machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from lanes import IDLE_HANG_S

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("outrate", "vllm_integration")


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=IDLE_HANG_S, env=env
    )
    assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _shipped(root: Path) -> set[str]:
    """What the wheel must carry: every tracked file of the two packages that
    is read at run time (modules, py.typed, the schema)."""
    tracked = subprocess.run(
        ["git", "ls-files", *PACKAGES], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    return {f for f in tracked if f.endswith((".py", ".json", "py.typed"))}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the fresh venv it is installed in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--quiet", "-w", tmp / "dist", REPO, cwd=tmp,
    )  # fmt: skip
    [wheel] = (tmp / "dist").glob("outrate-*.whl")
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    # Beside the vLLM under test: the fresh venv sees this venv's packages
    # (vLLM, torch, outrate's dependencies) through a .pth line; the outrate
    # of this venv is an editable install, whose own .pth is not processed
    # there, so `outrate` and `vllm_integration` can only come from the wheel.
    here = sysconfig.get_paths()["purelib"]
    [site] = (venv / "lib").glob("python3*/site-packages")
    (site / "beside.pth").write_text(here + "\n")
    _run(
        sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install",
        "--no-deps", "--quiet", wheel, cwd=tmp,
    )  # fmt: skip
    return wheel, venv


def test_the_wheel_carries_every_module_and_data_file(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_shipped(REPO) - names)
    assert not missing, f"not in the wheel: {missing}"
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "outrate = vllm_integration.startup.plugin:register" in text
    assert "outrate_cpu = vllm_integration.startup.plugin:register_cpu_fixes" in text


def test_lint_runs_from_the_installed_wheel(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, venv = installed
    python = venv / "bin" / "python"
    where = _run(
        python, "-c", "import outrate, vllm_integration; "
        "print(outrate.__file__); print(vllm_integration.__file__)", cwd=tmp_path,
    )  # fmt: skip
    assert all(line.startswith(str(venv)) for line in where.split()), where
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\ndefault: 100\nusers:\n  alice: {rate: 20, max_streams: 4}\n")
    said = _run(venv / "bin" / "outrate", "lint", policy, cwd=tmp_path)
    assert said.startswith("ok"), said
    schema = _run(venv / "bin" / "outrate", "schema", cwd=tmp_path)
    assert schema == (REPO / "policies" / "policy.schema.json").read_text()


def test_the_installed_plugin_adds_its_flags_to_vllm_serve(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    _, venv = installed
    env = {**os.environ, "PYTHONPATH": ""}
    said = _run(venv / "bin" / "outrate", "serve", "--help=all", cwd=tmp_path, env=env)
    for flag in ("--outrate-policy", "--outrate-store", "--outrate-trace"):
        assert flag in said, said[-3000:]
