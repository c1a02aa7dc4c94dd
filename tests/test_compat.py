"""vllm_integration/common/compat.py: the supported range, the patch index against the
installed vLLM, and what an unsupported or changed vLLM gets.

These run on every vLLM leg (`make test` on 0.32, `make test-vllm VLLM=0.33.0`
and `VLLM=0.34.0`):
the index must name a real target for every row of the version installed.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from lanes import IDLE_HANG_S  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from vllm_integration.common import versions  # noqa: E402
from vllm_integration.common.compat import PatchError, check_overrides, locate  # noqa: E402
from vllm_integration.common.patches import PATCHES
from vllm_integration.common.versions import is_supported, minor, vllm_version  # noqa: E402
from vllm_integration.startup import plugin  # noqa: E402
from vllm_integration.step.scheduler import OutrateMixin  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_the_installed_vllm_is_supported() -> None:
    assert is_supported(vllm_version()), vllm_version()
    checked = ("0.31.9", "0.32.0", "0.32.4", "0.33.0", "0.34.0", "0.34.2", "0.35.0", "1.0.0")
    assert [is_supported(v) for v in checked] == [False, True, True, True, True, True, False, False]


def test_every_patch_finds_its_target_on_the_installed_vllm() -> None:
    here = minor(vllm_version())
    rows = [p for p in PATCHES if here in p.versions]
    names = [p.target for p in rows]
    assert len(names) == len(set(names)), "two rows of one patch for one version"
    for p in rows:
        for owner, attr in locate(p.target):
            assert hasattr(owner, attr)
    assert all(p.versions and set(p.versions) <= set(versions.SUPPORTED_MINORS) for p in PATCHES)


def test_every_scheduler_override_takes_vllms_parameters() -> None:
    check_overrides(OutrateMixin, Scheduler)


def test_a_missing_target_is_an_error_that_names_the_patch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    [(module, name)] = locate("_SENSITIVE_ARG_FIELDS")
    monkeypatch.delattr(module, name)
    with pytest.raises(PatchError) as info:
        locate("_SENSITIVE_ARG_FIELDS")
    said = str(info.value)
    assert said.startswith("patch '_SENSITIVE_ARG_FIELDS' (startup/plugin.py): vLLM ")
    assert f"has no {module.__name__}:{name}" in said


def test_a_renamed_or_changed_override_target_is_an_error() -> None:
    class Renamed:  # vLLM without one method outrate overrides
        def schedule(self, throttle_prefills: bool = False) -> None: ...

    with pytest.raises(
        PatchError, match=r"patch 'Scheduler\.\w+' \(step/scheduler\.py\): .* has no"
    ):
        check_overrides(OutrateMixin, Renamed)

    class Mixin:
        def add_request(self, request: object) -> None: ...

    class Changed:
        def add_request(self, request: object, priority: int) -> None: ...

    with pytest.raises(PatchError, match=r"Changed\.add_request takes \['self', 'request', "):
        check_overrides(Mixin, Changed)


def test_an_unsupported_vllm_is_left_as_shipped_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_integration.startup import cpu_amx, cpu_spin

    def never(*a: object) -> None:
        raise AssertionError("a CPU fix ran on an unsupported vLLM")

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_warned", False)
    monkeypatch.setattr(versions, "vllm_version", lambda: "0.35.0")
    monkeypatch.setattr(cpu_amx, "enable_amx", never)
    monkeypatch.setattr(cpu_spin, "install_spin_sleep", never)
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "--model", "m"])
    before = (EngineArgs.__dict__["add_cli_args"], EngineArgs.__dict__["from_cli_args"])
    with caplog.at_level(logging.WARNING, logger="vllm.outrate"):
        plugin.register()
        plugin.register()  # idempotent: still one warning
        plugin.register_cpu_fixes()  # the outrate_cpu entry point stays out too
    said = [r.getMessage() for r in caplog.records if r.name == "vllm.outrate"]
    assert said == [
        "outrate: vLLM 0.35.0 is not supported by outrate (supported: vllm>=0.32,<0.35); "
        "outrate adds no flags and patches nothing, vLLM runs as shipped (to run outrate on "
        "it untested: `outrate doctor`, then OUTRATE_UNTESTED_VLLM=0.35.0)"
    ]
    assert (EngineArgs.__dict__["add_cli_args"], EngineArgs.__dict__["from_cli_args"]) == before


# vLLM's own CLI, in a fresh process, on a vLLM that says it is 0.35.0.
_CLI = """
import sys
from vllm_integration.common import versions
versions.vllm_version = lambda: "0.35.0"
from vllm_integration.startup.launcher import _answer_vllm_version
_answer_vllm_version()
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "serve", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("asks_for_outrate", [False, True], ids=["help", "policy"])
def test_vllm_serve_on_an_unsupported_vllm(asks_for_outrate: bool) -> None:
    argv = ["--outrate-policy", "policies/minimal.yaml"] if asks_for_outrate else ["--help=all"]
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CLI), *argv],
        capture_output=True,
        text=True,
        timeout=IDLE_HANG_S,
        cwd=REPO,
    )
    if asks_for_outrate:
        assert done.returncode == 1, done.stderr[-2000:]
        assert done.stderr.strip().splitlines()[-1] == (
            "outrate: vLLM 0.35.0 is not supported by outrate (supported: vllm>=0.32,<0.35); "
            "outrate adds no flags and patches nothing, vLLM runs as shipped (to run outrate "
            "on it untested: `outrate doctor`, then OUTRATE_UNTESTED_VLLM=0.35.0); "
            "--outrate-policy cannot be honoured"
        )
        assert "Traceback" not in done.stderr
    else:
        assert done.returncode == 0, done.stderr[-2000:]
        assert "--max-num-seqs" in done.stdout and "--outrate-policy" not in done.stdout
        assert done.stderr.count("is not supported by outrate") == 1
