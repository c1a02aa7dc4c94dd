"""The commands that take `vllm serve` flags after `--` (`outrate lint`,
`outrate simulate`): everything after `--` is vLLM's, never a policy or a
workload path, and click alone would hand it to the positional arguments."""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand

VLLM_ARGS = "outrate.vllm_args"
"""Where the command finds the flags after `--`: `ctx.meta[VLLM_ARGS]`."""


class SplitAtDoubleDash(TyperCommand):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "--" in args:
            at = args.index("--")
            ctx.meta[VLLM_ARGS] = args[at + 1 :]
            args = args[:at]
        return super().parse_args(ctx, args)
