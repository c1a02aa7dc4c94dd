#!/usr/bin/env python3
"""Install outrate and one vLLM release (the CUDA wheel) into a venv.

    python3 ops/install-vllm.py VERSION VENV

Creates VENV when missing and installs `-e '.[test,simulate]'` and vLLM
VERSION into it, for the scheduler- and plugin-level tests on the CPU
(`make test-vllm VLLM=VERSION`). Standard library only: run it with the
system python3.

One code path for every release:

1. `pip install --no-deps vllm==VERSION`;
2. read vLLM's requirement list from the installed distribution's metadata
   (importlib.metadata in the venv's python; environment markers evaluated,
   requirements that only an extra asks for skipped);
3. drop the requirements named for VERSION in UNSATISFIABLE below, and only
   those;
4. install the rest in one pip call together with the project;
5. `pip check`, tolerating only the lines about what step 3 dropped.

A release with no row in UNSATISFIABLE (0.33.0) drops nothing, and then
steps 1-4 install what `pip install vllm==VERSION` would.

One venv per release (the Makefile's `.venv-vllm-VERSION`): a venv that
holds another release is refused, not switched. A switched venv keeps what
the other release needed, and then is not what a new one would be: switching
0.33.0 to 0.34.0 kept flashinfer 0.7.2.post1 and the cuda-python it pins,
and with `--upgrade-strategy eager` failed pip check (docs/development.md).

Idempotent: a stamp file inside the venv records the vLLM release, the
hash of pyproject.toml and what was dropped; a rerun with all three
unchanged does nothing. Any pip failure exits non-zero with the command
that failed, and leaves no stamp.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP_NAME = ".outrate-vllm-stamp.json"
PROJECT = ".[test,simulate]"

# Requirements of a vLLM release that this package index cannot satisfy,
# by release: each is left out of the install, with the reason. Remove a
# row once the index has what it pins. A row naming a requirement that the
# release does not have fails the install (the table is stale).
UNSATISFIABLE: dict[str, dict[str, str]] = {
    "0.34.0": {
        "flashinfer-python": (
            "vLLM 0.34.0 pins flashinfer-python==0.7.3, which the index lacks "
            "(it has 0.7.2.post1 and 0.7.4). flashinfer is the GPU attention and "
            "sampling kernel library; vLLM imports it only in its CUDA attention "
            "backends and GPU kernels, never from the scheduler, the config or the "
            "CPU platform, which is all these tests run"
        ),
    },
}

# Run in the venv's python: vLLM's requirements that apply to this
# interpreter and platform with no extra asked for.
# Markers are evaluated with the venv's own pip's copy of `packaging`, so
# the venv needs nothing but pip at this point.
READ_REQUIREMENTS = r"""
import json
from importlib.metadata import distribution
try:
    from pip._vendor.packaging.requirements import Requirement
except ImportError:
    from packaging.requirements import Requirement
dist = distribution("vllm")
requires = []
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform or Python, or an extra's requirement
    req.marker = None
    requires.append([req.name, str(req)])
print(json.dumps({"version": dist.version, "requires": requires}))
"""


class InstallError(Exception):
    pass


def say(message: str) -> None:
    print(f"install-vllm: {message}", flush=True)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run(
    cmd: list[str], *, capture: bool = False, label: str | None = None
) -> subprocess.CompletedProcess[str]:
    say("$ " + (label or shlex.join(cmd)))
    result = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=capture)
    if result.returncode != 0:
        if capture:
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
        raise InstallError(f"exit {result.returncode} from: {label or shlex.join(cmd)}")
    return result


def pip(python: Path, *args: str) -> None:
    run([str(python), "-m", "pip", "--disable-pip-version-check", *args])


def wanted_stamp(version: str) -> dict[str, object]:
    pyproject = (ROOT / "pyproject.toml").read_bytes()
    return {
        "vllm": version,
        "pyproject_sha256": hashlib.sha256(pyproject).hexdigest(),
        "dropped": sorted(UNSATISFIABLE.get(version, {})),
    }


def read_stamp(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def installed_vllm(python: Path) -> str | None:
    """The vLLM release the venv holds, or None."""
    probe = "import importlib.metadata as m; print(m.version('vllm'))"
    result = subprocess.run([str(python), "-c", probe], text=True, capture_output=True)
    return result.stdout.strip() if result.returncode == 0 else None


def vllm_requirements(python: Path, version: str) -> list[tuple[str, str]]:
    """vLLM's requirements, as (name, requirement)."""
    label = f"{python} -c <read vllm's requirements from its metadata>"
    data = json.loads(run([str(python), "-c", READ_REQUIREMENTS], capture=True, label=label).stdout)
    if data["version"] != version:
        raise InstallError(f"the venv has vllm {data['version']}, not {version}")
    return [(name, spec) for name, spec in data["requires"]]


def split_dropped(
    version: str, requires: list[tuple[str, str]]
) -> tuple[list[str], dict[str, str]]:
    """(requirements to install, {dropped requirement: why})."""
    drop = {canonical(name): why for name, why in UNSATISFIABLE.get(version, {}).items()}
    keep: list[str] = []
    dropped: dict[str, str] = {}
    for name, spec in requires:
        if canonical(name) in drop:
            dropped[spec] = drop[canonical(name)]
        else:
            keep.append(spec)
    stale = set(drop) - {canonical(name) for name, _ in requires}
    if stale:
        raise InstallError(
            f"UNSATISFIABLE names {sorted(stale)} for vllm {version}, which does not "
            "require them: fix the table in ops/install-vllm.py"
        )
    return keep, dropped


def check(python: Path, dropped_names: set[str]) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", "check"]
    say("$ " + shlex.join(cmd))
    result = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
    output = (result.stdout + result.stderr).strip()
    print(output, flush=True)
    if result.returncode == 0:
        return

    # pip check must report what was dropped on purpose ("vllm 0.34.0 requires
    # flashinfer-python, which is not installed."): that line is the expected
    # result of UNSATISFIABLE, not a broken venv. Any other line is one.
    def about_dropped(line: str) -> bool:
        line = canonical(line)
        return any(
            re.search(rf"\b(requires|requirement) {re.escape(name)}\b", line)
            for name in dropped_names
        )

    others = [line for line in output.splitlines() if line.strip() and not about_dropped(line)]
    if others:
        raise InstallError("pip check found problems besides the dropped requirements")
    say("pip check: only the dropped requirements are missing (expected)")


def install(version: str, venv: Path) -> None:
    stamp_path = venv / STAMP_NAME
    python = venv / "bin" / "python"
    stamp = wanted_stamp(version)
    if python.exists() and read_stamp(stamp_path) == stamp:
        say(f"{venv} already has vllm {version} and this pyproject.toml: nothing to do")
        return

    started = time.monotonic()
    if not python.exists():
        say(f"creating {venv}")
        run([sys.executable, "-m", "venv", str(venv)])
    other = installed_vllm(python)
    if other not in (None, version):
        raise InstallError(
            f"{venv} holds vllm {other}: use one venv per release "
            f"(make test-vllm VLLM={version} uses .venv-vllm-{version}), or delete it"
        )
    stamp_path.unlink(missing_ok=True)  # a failed install leaves no stamp

    say(f"installing vllm {version} without its dependencies")
    pip(python, "install", "--quiet", "--no-deps", f"vllm=={version}")
    keep, dropped = split_dropped(version, vllm_requirements(python, version))
    for spec, why in dropped.items():
        say(f"dropped {spec}: {why}")
    if not dropped:
        say("dropped nothing: every requirement of this release is installable")
    say(f"installing {PROJECT} and vllm's {len(keep)} other requirements (a few GB)")
    pip(python, "install", "--quiet", "-e", PROJECT, *keep)
    check(python, {canonical(name) for name in UNSATISFIABLE.get(version, {})})

    stamp_path.write_text(json.dumps(stamp, indent=1) + "\n")
    say(f"{venv} ready with vllm {version} in {time.monotonic() - started:.0f} s")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", argv[0]):
        print("usage: python3 ops/install-vllm.py VERSION VENV  (e.g. 0.34.0 .venv-vllm-0.34.0)")
        return 2
    version, venv = argv[0], Path(argv[1]).resolve()
    try:
        install(version, venv)
    except InstallError as error:
        say(f"FAILED: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
