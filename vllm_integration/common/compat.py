"""Where each patch of the index finds its target on the installed vLLM.

Every difference between the supported versions lives in versions.py, here,
or in the patch index (`vllm_integration.common.patches.PATCHES`, column
`versions`): a patch site asks `locate(name)` for its target instead of
importing it, so on a vLLM where the target moved or is gone startup stops
with a message that names the patch, never an `AttributeError` later.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from outrate.errors import OutrateError
from vllm_integration.common.patches import PATCHES
from vllm_integration.common.versions import SUPPORTED, index_minor, vllm_version


class PatchError(OutrateError):
    """A patch of the index whose target this vLLM does not have (or changed)."""


def _patch(name: str, version: str) -> Any:
    for patch in _patches():
        if patch.target == name and index_minor(version) in patch.versions:
            return patch
    raise PatchError(f"patch index: no entry {name!r} for vLLM {version}")


def resolve(location: str) -> tuple[Any, str]:
    """(owner, attribute) of `module:Qual.name`; ImportError or AttributeError if absent."""
    module_name, _, path = location.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    getattr(owner, attr)  # present, or AttributeError
    return owner, attr


def locate(name: str, version: str | None = None) -> list[tuple[Any, str]]:
    """(owner, attribute) of each place patch `name` of the index touches on
    this vLLM; a PatchError naming the patch if one is missing."""
    version = version or vllm_version()
    patch = _patch(name, version)
    found = []
    for location in patch.at:
        try:
            found.append(resolve(location))
        except (ImportError, AttributeError) as exc:
            raise PatchError(
                f"patch {name!r} ({patch.where}): vLLM {version} has no {location} "
                f"({type(exc).__name__}: {exc}); outrate supports vllm{SUPPORTED}"
            ) from exc
    return found


def owner_of(name: str) -> Any:
    """The object patch `name` patches (the owner of its first target)."""
    return locate(name)[0][0]


def check_overrides(mixin: type, base: type) -> None:
    """Each method `mixin` overrides exists on `base` and takes the same
    parameters, else a PatchError naming the patch: an override of a method
    vLLM renamed would never be called, one whose parameters moved would be
    called wrong."""
    version = vllm_version()
    for name, ours in vars(mixin).items():
        if name.startswith("__") or not callable(ours):
            continue
        patch_name = f"Scheduler.{name}"
        stock = getattr(base, name, None)
        if stock is None:
            if any(p.target == patch_name for p in _patches()):
                raise PatchError(
                    f"patch {patch_name!r} (step/scheduler.py): vLLM {version}'s {base.__name__} "
                    f"has no {name}; outrate supports vllm{SUPPORTED}"
                )
            continue  # a method of outrate's own
        if _parameters(ours) != _parameters(stock):
            raise PatchError(
                f"patch {patch_name!r} (step/scheduler.py): vLLM {version}'s "
                f"{base.__name__}.{name} takes {_parameters(stock)}, "
                f"outrate's override {_parameters(ours)}"
            )


def _patches() -> tuple[Any, ...]:
    return PATCHES


def _parameters(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)
