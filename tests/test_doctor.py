"""`outrate doctor` and the opt-in to a vLLM newer than the tested range.

A newer vLLM is faked on the installed one: its version says one minor past
the tested range, and the range is cut to end at the installed minor, so the
"newest tested column" of the patch index is the installed vLLM's own: every
target resolves, as on a release that changed nothing outrate touches. A
second fake adds a row whose target no vLLM has.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("vllm")

from lanes import IDLE_HANG_S  # noqa: E402

from outrate.cli import app  # noqa: E402
from vllm_integration.common import compat, patches, versions  # noqa: E402
from vllm_integration.common.patches import Patch  # noqa: E402
from vllm_integration.startup import doctor, plugin  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
INSTALLED = versions.minor(versions.vllm_version())
NEWER = f"{INSTALLED.split('.')[0]}.{int(INSTALLED.split('.')[1]) + 1}.0"


@pytest.fixture
def newer(monkeypatch: pytest.MonkeyPatch) -> str:
    """The installed vLLM, saying it is one minor past a range that ends at it."""
    monkeypatch.setattr(versions, "vllm_version", lambda: NEWER)
    monkeypatch.setattr(versions, "SUPPORTED_MINORS", (INSTALLED,))
    return NEWER


@pytest.fixture
def missing_target(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = Patch(
        "Scheduler.gone",
        "step/scheduler.py",
        "a target this vLLM does not have",
        "never",
        ("vllm.v1.core.sched.scheduler:Scheduler.no_such_method",),
        (INSTALLED,),
    )
    rows = (*patches.PATCHES, gone)
    monkeypatch.setattr(doctor, "PATCHES", rows)
    monkeypatch.setattr(compat, "PATCHES", rows)


def test_doctor_is_clean_on_the_installed_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main({}) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "outrate would start"
    for p in patches.PATCHES:
        if INSTALLED in p.versions:
            assert f"patch {p.target} ({p.where})" in out
    assert "scheduler overrides" in out


def _rows(out: str) -> dict[str, str]:
    """`what -> status` for each row `doctor.render` printed (the verdict aside)."""
    rows = [re.split(r"\s{2,}", line, maxsplit=2) for line in out.splitlines()[:-1]]
    return {row[0]: row[1] for row in rows}


def test_the_doctor_command_exits_0_and_says_outrate_would_start() -> None:
    """`python -m outrate doctor` in a process of its own: typer's entry, the
    lazy vLLM import and the exit status, not just `doctor.main`."""
    env = {k: v for k, v in os.environ.items() if k != versions.UNTESTED_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "outrate", "doctor"],
        capture_output=True,
        text=True,
        timeout=IDLE_HANG_S,
        cwd=REPO,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "outrate would start"
    rows = _rows(done.stdout)
    assert rows[f"vLLM {versions.vllm_version()}"] == "ok"
    assert rows["scheduler overrides"] == "ok"
    for p in patches.PATCHES:
        if INSTALLED in p.versions:
            assert rows[f"patch {p.target} ({p.where})"] == "ok"
    assert set(rows.values()) <= {"ok", "info"}, rows


def test_the_doctor_command_exits_1_where_outrate_would_not_start(newer: str) -> None:
    """The command's exit status follows the verdict (typer.Exit(main())):
    an unsupported vLLM is exit 1 with the way in. In CliRunner, as the other
    CLI tests: faking the version for a subprocess would cost a second vLLM
    import (about 17 s of CPU here)."""
    result = CliRunner().invoke(app, ["doctor"], env={versions.UNTESTED_ENV: None})
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[-1] == "outrate would NOT start"
    assert _rows(result.stdout)[f"vLLM {newer}"] == "unsupported"
    assert f"{versions.UNTESTED_ENV}={newer} runs outrate on it untested" in result.stdout


def test_a_newer_vllm_without_the_opt_in_is_refused_with_the_way_in(newer: str) -> None:
    findings = doctor.diagnose({})
    assert findings[0].status == "unsupported"
    assert f"OUTRATE_UNTESTED_VLLM={newer}" in findings[0].detail
    assert doctor.targets_ok(findings) and not doctor.ok(findings)


def test_a_newer_vllm_opted_in_whose_targets_all_resolve_starts(newer: str) -> None:
    findings = doctor.diagnose({"OUTRATE_UNTESTED_VLLM": newer})
    assert findings[0].status == "untested"
    assert doctor.ok(findings), doctor.render(findings)


def test_the_opt_in_names_one_version_only(newer: str) -> None:
    other = f"{newer}.1"
    assert not versions.opted_in(newer, {"OUTRATE_UNTESTED_VLLM": other})
    assert not versions.opted_in(newer, {"OUTRATE_UNTESTED_VLLM": "1"})
    assert not versions.opted_in(INSTALLED + ".0", {"OUTRATE_UNTESTED_VLLM": INSTALLED + ".0"})


def test_a_missing_target_fails_the_doctor_with_its_name(
    newer: str, missing_target: None, capsys: pytest.CaptureFixture[str]
) -> None:
    findings = doctor.diagnose({"OUTRATE_UNTESTED_VLLM": newer})
    bad = [f for f in findings if f.fails]
    assert [(f.what, f.status) for f in bad] == [
        ("patch Scheduler.gone (step/scheduler.py)", "missing")
    ]
    assert "Scheduler.no_such_method" in bad[0].detail
    assert doctor.main({"OUTRATE_UNTESTED_VLLM": newer}) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "outrate would NOT start"


def test_a_moved_target_is_reported_where_another_column_finds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = next(p for p in patches.PATCHES if INSTALLED in p.versions and p.at)
    moved = real._replace(at=("vllm.v1.core.sched.scheduler:Gone.attr",), versions=(INSTALLED,))
    elsewhere = real._replace(versions=("0.1",))
    rows = tuple(p for p in patches.PATCHES if p is not real) + (moved, elsewhere)
    monkeypatch.setattr(doctor, "PATCHES", rows)
    finding = doctor.patch_finding(moved, versions.vllm_version())
    assert finding.status == "moved"
    assert real.at[0] in finding.detail


def test_a_changed_signature_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    row = next(p for p in patches.PATCHES if p.params and INSTALLED in p.versions)
    changed = row._replace(params=(("self", "something_else"),) + row.params[1:])
    finding = doctor.patch_finding(changed, versions.vllm_version())
    assert finding.status == "changed"
    assert "something_else" in finding.detail


def _register_opted_in(
    newer: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> tuple[bool, list[str]]:
    """The plugin's `register()` in a fresh state with the opt-in set:
    (whether it patched, what it logged)."""
    calls: list[str] = []
    monkeypatch.setattr(plugin, "_register", lambda: calls.append("patched"))
    monkeypatch.setenv("OUTRATE_UNTESTED_VLLM", newer)
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_warned", False)
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "--model", "m"])
    with caplog.at_level(logging.WARNING, logger="vllm.outrate"):
        plugin.register()
    return bool(calls), [r.getMessage() for r in caplog.records if r.name == "vllm.outrate"]


def test_the_plugin_runs_on_an_opted_in_newer_vllm_and_says_so(
    newer: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    patched, said = _register_opted_in(newer, monkeypatch, caplog)
    assert patched
    assert len(said) == 1 and said[0].startswith(f"outrate: vLLM {newer} is newer than")
    assert "untested" in said[0]


def test_the_plugin_stays_out_of_an_opted_in_vllm_with_a_missing_target(
    newer: str,
    missing_target: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    patched, said = _register_opted_in(newer, monkeypatch, caplog)
    assert not patched
    assert "Scheduler.gone" in " ".join(said) and "runs as shipped" in " ".join(said)


# vLLM's own CLI in a fresh process, on the installed vLLM faked one minor newer.
_CLI = """
import sys
NEWER = sys.argv[1]
from vllm_integration.common import versions
installed = versions.minor(versions.vllm_version())
versions.vllm_version = lambda: NEWER
versions.SUPPORTED_MINORS = (installed,)
from vllm_integration.startup.launcher import _answer_vllm_version
_answer_vllm_version()
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "serve", "--help=all"]
main()
"""


@pytest.mark.parametrize("opt_in", [True, False], ids=["opted-in", "not-opted-in"])
def test_vllm_serve_help_on_a_newer_vllm(opt_in: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUTRATE_UNTESTED_VLLM"}
    if opt_in:
        env["OUTRATE_UNTESTED_VLLM"] = NEWER
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CLI), NEWER],
        capture_output=True,
        text=True,
        timeout=IDLE_HANG_S,
        cwd=REPO,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    logs = done.stdout + done.stderr
    if opt_in:
        assert "--outrate-policy" in done.stdout
        assert f"vLLM {NEWER} is newer than the releases outrate is tested on" in logs
    else:
        assert "--outrate-policy" not in done.stdout
        assert f"vLLM {NEWER} is not supported by outrate" in logs
