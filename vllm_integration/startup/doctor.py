"""`outrate doctor`: what outrate finds in the installed vLLM, before a restart.

A user runs it after upgrading vLLM, and CI runs it on every vLLM leg. It
reads the patch index (common/patches.py) against the installed vLLM, the
same way startup does (`compat.locate`, `compat.check_overrides`), and says
for each row what startup would meet:

- `ok`: every target found, with the parameters the wrapper relies on;
- `moved`: not where this version's column says, but where another column
  of the same patch says (the index needs a row for this version);
- `missing`: nowhere the index knows;
- `changed`: found, but its parameters are not the ones outrate's code passes.

`ok(findings)` is whether outrate would start: the plugin asks exactly this
before it runs on a vLLM newer than the tested range (opted in by
`OUTRATE_UNTESTED_VLLM`).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from vllm_integration.common import versions
from vllm_integration.common.compat import PatchError, check_overrides, resolve
from vllm_integration.common.patches import PATCHES, Patch
from vllm_integration.common.versions import UNTESTED_ENV


class Finding(NamedTuple):
    what: str
    status: str  # ok | moved | missing | changed | untested | unsupported | info
    detail: str

    @property
    def fails(self) -> bool:
        return self.status in ("moved", "missing", "changed", "unsupported")


def version_finding(version: str, environ: Mapping[str, str]) -> Finding:
    if versions.is_supported(version):
        return Finding(f"vLLM {version}", "ok", f"in the tested range vllm{versions.SUPPORTED}")
    if versions.is_newer(version):
        if versions.opted_in(version, environ):
            return Finding(
                f"vLLM {version}",
                "untested",
                f"newer than vllm{versions.SUPPORTED}; {UNTESTED_ENV}={version} is set: "
                "outrate runs on it if every row below is ok",
            )
        return Finding(
            f"vLLM {version}",
            "unsupported",
            f"newer than vllm{versions.SUPPORTED}: outrate stays out (vLLM runs as shipped); "
            f"if every row below is ok, {UNTESTED_ENV}={version} runs outrate on it untested",
        )
    return Finding(f"vLLM {version}", "unsupported", f"outrate supports vllm{versions.SUPPORTED}")


def _params(obj: Any) -> list[str] | None:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def patch_finding(patch: Patch, version: str) -> Finding:
    """Where each target of one row of the index is on this vLLM."""
    what = f"patch {patch.target} ({patch.where})"
    for n, location in enumerate(patch.at):
        try:
            owner, attr = resolve(location)
        except (ImportError, AttributeError):
            elsewhere = [
                other
                for row in PATCHES
                if row.target == patch.target and row is not patch
                for other in row.at
                if other != location and _resolves(other)
            ]
            if elsewhere:
                return Finding(what, "moved", f"not at {location}; found at {elsewhere[0]}")
            return Finding(what, "missing", f"no {location}")
        expected = patch.params[n] if n < len(patch.params) else ()
        if expected:
            got = _params(getattr(owner, attr))
            if got is None or tuple(got[: len(expected)]) != expected:
                return Finding(
                    what, "changed", f"{location} takes {got}, outrate passes {list(expected)}"
                )
    where = ", ".join(patch.at) if patch.at else "nothing to resolve"
    return Finding(what, "ok", where)


def _resolves(location: str) -> bool:
    try:
        resolve(location)
    except (ImportError, AttributeError):
        return False
    return True


def override_findings() -> list[Finding]:
    """The scheduler's overrides against vLLM's `Scheduler`: one finding."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_integration.step.scheduler import OutrateMixin

    try:
        check_overrides(OutrateMixin, Scheduler)
    except PatchError as exc:
        return [Finding("scheduler overrides", "changed", str(exc))]
    names = sorted(
        n for n, v in vars(OutrateMixin).items() if callable(v) and hasattr(Scheduler, n)
    )
    return [Finding("scheduler overrides", "ok", f"{len(names)} methods: {', '.join(names)}")]


def cpu_findings(environ: Mapping[str, str]) -> list[Finding]:
    """Whether the CPU platform fixes apply here (information, never a failure)."""
    import torch

    from vllm_integration.startup.cpu_amx import on_cpu_platform
    from vllm_integration.startup.cpu_spin import ENV

    if not on_cpu_platform():
        return [Finding("CPU fixes", "info", "not vLLM's CPU platform: none apply")]
    reported = torch.cpu._is_amx_tile_supported()
    amx = "asked for at start (the CPU reports AMX)" if reported else "not needed (no AMX)"
    spin = environ.get(ENV)
    sleep = f"{ENV}={spin} us" if spin else f"off ({ENV} unset; `outrate serve` sets 100)"
    return [
        Finding("CPU fix: AMX permission", "info", amx),
        Finding("CPU fix: spin sleep", "info", sleep),
    ]


def diagnose(environ: Mapping[str, str] = os.environ) -> list[Finding]:
    version = versions.vllm_version()
    findings = [version_finding(version, environ)]
    if version == "none":
        return findings
    column = versions.index_minor(version)
    rows = [p for p in PATCHES if column in p.versions]
    findings += [patch_finding(p, version) for p in rows]
    findings += override_findings()
    findings += cpu_findings(environ)
    return findings


def ok(findings: list[Finding]) -> bool:
    """Whether outrate would start: nothing fails (an unsupported version does)."""
    return not any(f.fails for f in findings)


def targets_ok(findings: list[Finding]) -> bool:
    """Whether every target resolves (the version itself aside)."""
    return not any(f.fails for f in findings[1:])


def render(findings: list[Finding]) -> str:
    width = max(len(f.what) for f in findings)
    lines = [f"{f.what:<{width}}  {f.status:<11}  {f.detail}" for f in findings]
    verdict = "outrate would start" if ok(findings) else "outrate would NOT start"
    return "\n".join([*lines, verdict])


def main(environ: Mapping[str, str] = os.environ) -> int:
    findings = diagnose(environ)
    sys.stdout.write(render(findings) + "\n")
    return 0 if ok(findings) else 1
