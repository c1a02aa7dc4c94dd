"""The simulated engine's configuration, read from `vllm serve` flags.

`outrate simulate ... -- FLAGS` takes the flags the real server would get and
reads them the way `outrate lint` does (`outrate.check.deployment`: the same
spelling rules, `--config` files, unknown flags refused), so a deployment
that lint refuses is refused here too. The scheduler settings lint does not
need (batch size, scheduling policy, KV cache size, block size, prefix
caching, the model's length) are read here, from the same normalised argv.

Defaults are vLLM 0.32's for an API server on a GPU other than the largest
ones (`EngineArgs._get_default_max_num_seqs_and_batched_tokens`): 256
sequences, 2048 batched tokens, chunked prefill and prefix caching on, FCFS,
blocks of 16 tokens. The KV cache's size depends on the GPU and the model, so
it is not guessed: without `--num-gpu-blocks-override` (blocks) or
`--kv-cache-tokens` (simulate's own option, tokens) it holds every sequence
at full length, and KV never runs out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import yaml

from outrate.check.deployment import DeploymentError, check_serve_argv, load_deployment
from outrate.check.rules import lint_deployment
from outrate.check.serve_args import read_vllm_config
from outrate.errors import OutrateError

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_BLOCK_SIZE = 16

_EXTRA = {
    "max-num-batched-tokens": "max_num_batched_tokens",
    "num-gpu-blocks-override": "num_blocks",
    "block-size": "block_size",
    "max-model-len": "max_model_len",
    "scheduling-policy": "scheduling_policy",
}
_EXTRA_BOOL = {"enable-prefix-caching": "prefix_caching"}


@dataclass(frozen=True)
class EngineSpec:
    """What the simulated scheduler is built with."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_active_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    """None: 2048, or with chunked prefill off one whole request (vLLM's rule)."""
    chunked_prefill: bool = True
    prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    """KV cache blocks; None: enough for every sequence at `max_model_len`."""
    max_model_len: int | None = None
    """None: the workload's longest request (prompt + output)."""
    flags: tuple[str, ...] = ()

    def batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.chunked_prefill:
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)

    def blocks_for(self, max_model_len: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        per_seq = -(-max_model_len // self.block_size)
        return per_seq * self.max_num_seqs + 1  # vLLM keeps one null block

    def describe(self) -> str:
        active = self.max_num_active_seqs
        kv = f"{self.num_blocks} blocks" if self.num_blocks is not None else "unbounded"
        parts = [
            f"max-num-seqs {self.max_num_seqs}",
            f"max-num-active-seqs {active if active is not None else self.max_num_seqs}",
            f"max-num-batched-tokens {self.max_num_batched_tokens or 'default'}",
            "chunked prefill" if self.chunked_prefill else "no chunked prefill",
            self.scheduling_policy,
            "async" if self.async_scheduling else "sync",
            f"KV {kv} of {self.block_size}",
        ]
        return ", ".join(parts)


def _int(name: str, raw: Any, minimum: int = 1) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise DeploymentError(f"--{name}: expected an integer (got {raw!r})") from None
    if isinstance(raw, bool) or value < minimum:
        raise DeploymentError(f"--{name}: must be >= {minimum} (got {raw!r})")
    return value


def _convert(name: str, raw: Any) -> Any:
    if name == "scheduling-policy":
        if raw not in ("fcfs", "priority"):
            raise DeploymentError(f"--scheduling-policy: must be fcfs or priority (got {raw!r})")
        return raw
    return _int(name, raw)


def _from_config_files(paths: list[str]) -> dict[str, Any]:
    """The extra settings from `--config` YAML files (already checked
    readable by `load_deployment`)."""
    out: dict[str, Any] = {}
    for path in paths:
        data = yaml.safe_load(read_vllm_config(path)) or {}
        for key, value in data.items() if isinstance(data, dict) else ():
            name = str(key).replace("_", "-")
            if name in _EXTRA:
                out[_EXTRA[name]] = _convert(name, value)
            elif name in _EXTRA_BOOL:
                out[_EXTRA_BOOL[name]] = bool(value)
            elif name.startswith("no-") and name[3:] in _EXTRA_BOOL:
                out[_EXTRA_BOOL[name[3:]]] = not value
    return out


def _extras(argv: list[str]) -> dict[str, Any]:
    """Settings lint does not read, from argv spelled out by `check_serve_argv`
    (full names, `--x=v` or `--x v`); the last one given wins, as in argparse."""
    out: dict[str, Any] = {}
    configs: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            continue
        head, eq, value = arg[2:].partition("=")
        if head == "config" or head in _EXTRA:
            if not eq:
                value, i = argv[i], i + 1  # check_serve_argv made sure it is there
            if head == "config":
                configs.append(value)
            else:
                out[_EXTRA[head]] = _convert(head, value)
        elif head in _EXTRA_BOOL:
            out[_EXTRA_BOOL[head]] = True
        elif head.startswith("no-") and head[3:] in _EXTRA_BOOL:
            out[_EXTRA_BOOL[head[3:]]] = False
    return {**_from_config_files(configs), **out}


def engine_from_flags(argv: list[str], kv_cache_tokens: int | None = None) -> EngineSpec:
    """The engine `vllm serve ARGV` would run, for the simulator. Raises
    OutrateError where lint would fail the deployment (an error finding) or
    the flags cannot be read."""
    flags = [a for a in argv if a != "serve"]
    normal = check_serve_argv(flags)
    dep = load_deployment(argv=flags, strict_flags=True, source="vllm serve flags")
    errors = [f for f in lint_deployment(dep) if f.severity == "error"]
    if errors:
        lines = "\n  ".join(map(str, errors))
        raise OutrateError(f"outrate cannot run under this vLLM configuration:\n  {lines}")
    extra = _extras(normal)
    spec = EngineSpec(
        max_num_seqs=dep.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        max_num_active_seqs=dep.max_num_active_seqs,
        chunked_prefill=dep.chunked_prefill if dep.chunked_prefill is not None else True,
        async_scheduling=bool(dep.async_scheduling),
        flags=tuple(flags),
        **extra,
    )
    if spec.max_num_active_seqs is not None and spec.max_num_active_seqs > spec.max_num_seqs:
        raise OutrateError(
            f"--max-num-active-seqs ({spec.max_num_active_seqs}) must not exceed "
            f"--max-num-seqs ({spec.max_num_seqs})"
        )
    if kv_cache_tokens is not None:
        if kv_cache_tokens < spec.block_size:
            raise OutrateError(f"--kv-cache-tokens must be at least one block ({spec.block_size})")
        spec = replace(spec, num_blocks=kv_cache_tokens // spec.block_size + 1)
    return spec


def with_flag(argv: list[str], name: str, value: str) -> list[str]:
    """`argv` with `--name value` appended (later flags win): a sweep's point."""
    return [*argv, f"--{name.removeprefix('--')}", value]


def max_model_len_for(spec: EngineSpec, longest: int | None) -> int:
    """The model length the simulated engine takes: the flag, else the
    workload's longest request, else 8192."""
    if spec.max_model_len is not None:
        return spec.max_model_len
    return max(longest or 8192, 16)
