"""A neutral description of a vLLM deployment, read without importing vLLM.

`outrate lint` must say "this engine cannot enforce your policy" before anyone
starts a GPU, so it reads the same inputs `vllm serve` reads (its flags and its
`--config` YAML) with a small parser of its own (`outrate.check.serve_args`),
keeping only what outrate cares about, plus where each value came from. The
engine integration can build a `Deployment` from the real `VllmConfig` instead
and run the same lint rules.

Merged like vLLM merges them: a `--config` file is applied first and
command-line flags override it. `check_serve_argv` refuses what `vllm serve`
itself would refuse, from the flag lists of every supported vLLM.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from outrate.check.outrate_flags import FlagError, check_flags_together
from outrate.check.serve_args import (
    OUTRATE_TARGETS,
    DeploymentError,
    Settings,
    settings_from_argv,
    settings_from_config,
)

__all__ = [
    "Deployment",
    "DeploymentError",
    "check_serve_argv",
    "deployment_from_args",
    "deployment_from_config",
    "load_deployment",
]


@dataclass(frozen=True)
class Deployment:
    """What outrate needs to know about a vLLM engine. Defaults are vLLM 0.32's.

    `None` means "not set: vLLM decides" (e.g. `max_num_seqs` depends on the
    hardware and `chunked_prefill` is on for generative models).
    """

    speculative: bool = False
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    kv_connector: str | None = None
    ec_connector: str | None = None
    kv_offload: bool = False
    aux_output: bool = False
    scheduler_cls: str | None = None
    max_num_seqs: int | None = None
    max_num_active_seqs: int | None = None
    chunked_prefill: bool | None = None
    max_model_len: int | None = None
    """`--max-model-len`; None: the model's own (unknown without the model)."""
    async_scheduling: bool | None = None
    store: bool = False
    """`--outrate-store` given: budgets are shared between engines."""
    store_fallback: str | None = None
    """`--outrate-store-fallback` as given (`local` when unset; `share` is
    the deprecated name of `pause`)."""
    store_engines: int | None = None
    """`--outrate-store-engines`: engines expected to share the store."""
    store_hold_s: float | None = None
    """`--outrate-store-hold-s` (30 when unset)."""
    trace: str | None = None
    """`--outrate-trace`, absolute, checked like the server checks it."""
    policy: str | None = None
    """`--outrate-policy` as given (`outrate lint` lints that file too)."""
    reload: str | None = None
    """`--outrate-reload` (watch when unset)."""
    trace_max_bytes: int | None = None
    """`--outrate-trace-max-bytes`."""
    store_lease_ms: int | None = None
    """`--outrate-store-lease-ms`."""
    quota_file: str | None = None
    """`--outrate-quota-file`, absolute: where the engine keeps quota usage."""
    default_rate: float | None = None
    """`--default-user-output-tokens-per-second` (the in-memory policy)."""
    user_rates: str | None = None
    """`--user-output-tokens-per-second`, its JSON text (the in-memory policy)."""
    model_kind: str | None = None
    """"multimodal", "encoder-decoder", "hybrid", "attention-free", "diffusion",
    or None (plain decoder-only text, or unknown from flags alone)."""
    host: str | None = None
    """`--host`; None binds every interface (vLLM's default)."""
    uds: str | None = None
    """`--uds`: a Unix socket instead of TCP (host and port are ignored)."""
    api_key: bool = False
    """vLLM's own `--api-key` is set (the keys themselves are never kept)."""
    api_server_count: int | None = None
    """`--api-server-count`; None: vLLM's default (one API server, but as
    many as data-parallel ranks with data parallel)."""
    source: str = "defaults"
    locations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """field name -> where it was set: `serve.yaml:3:1` or `--max-num-seqs`."""

    def where(self, name: str) -> str:
        """Where field `name` was set, or the whole description's source."""
        return self.locations.get(name, self.source)

    @property
    def loopback_only(self) -> bool:
        """Whether only this machine can connect: a Unix socket, `localhost`,
        or a loopback address. No `--host` binds every interface."""
        if self.uds:
            return True
        if self.host is None:
            return False
        host = self.host.strip().strip("[]")
        if host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything

    def listening_on(self) -> str:
        if self.host is None:
            return "every interface (no --host: vLLM binds 0.0.0.0)"
        return f"--host {self.host}"


def _build(settings: Settings, source: str) -> Deployment:
    values = {name: value for name, (value, _) in settings.items()}
    where = MappingProxyType({name: loc for name, (_, loc) in settings.items()})
    return Deployment(**values, source=source, locations=where)


def deployment_from_config(path: str | os.PathLike[str]) -> Deployment:
    """Read a `vllm serve --config` YAML file."""
    source = os.fspath(path)
    return _build(settings_from_config(source), source)


def deployment_from_args(argv: list[str], source: str = "command line") -> Deployment:
    """Read `vllm serve` arguments; a `--config FILE` among them is applied first."""
    return load_deployment(argv=argv, source=source)


def load_deployment(
    config: str | os.PathLike[str] | None = None,
    argv: list[str] | None = None,
    source: str = "command line",
    strict_flags: bool = False,
) -> Deployment:
    """Merge like vLLM: config files first (`config`, then any `--config` in argv),
    then the flags in argv on top. `strict_flags`: refuse what vllm serve would
    refuse (`check_serve_argv`), as `outrate lint` does."""
    argv = check_serve_argv(list(argv or [])) if strict_flags else list(argv or [])
    from_argv, argv_configs = settings_from_argv(argv)
    paths = ([os.fspath(config)] if config is not None else []) + argv_configs
    settings: Settings = {}
    for path in paths:
        settings.update(settings_from_config(path))
    settings.update(from_argv)
    _check_together(settings)
    if argv:
        name = source
    elif paths:
        name = paths[0]
    else:
        name = "defaults"
    return _build(settings, name)


def _check_together(settings: Settings) -> None:
    """The server's rules between its `--outrate-*` flags, on the merged
    settings (each value was checked as it was read)."""
    values = {
        name: settings[field][0] for name, field in OUTRATE_TARGETS.items() if field in settings
    }
    data_parallel = settings.get("data_parallel_size", (1, ""))[0] or 1
    try:
        check_flags_together(values, data_parallel)
    except FlagError as e:
        raise DeploymentError(str(e)) from e


# -- vllm serve's own argument rules -------------------------------------------

_NUMBER = re.compile(r"-\d+(\.\d*)?([eE][-+]?\d+)?|-\.\d+")


def _serve_flag_arity() -> dict[str, str]:
    """Every flag of every supported vLLM -> its arity. Lint cannot know which
    vLLM a deployment runs, so it accepts a flag any of them accepts. A flag
    whose arity differs between versions takes the newer one's."""
    from outrate.check import vllm_flags_0_32, vllm_flags_0_33, vllm_flags_0_34

    arity: dict[str, str] = {}
    for f in (vllm_flags_0_32, vllm_flags_0_33, vllm_flags_0_34):
        groups = (
            (f.NO_VALUE, "0"),
            (f.ONE_VALUE, "1"),
            (f.OPTIONAL_VALUE, "?"),
            (f.SOME_VALUES, "+"),
        )
        arity.update({flag: n for flags, n in groups for flag in flags})
    return arity


def _resolve_flag(head: str, arity: dict[str, str]) -> str:
    """The full name of `head` (`--max_num_seqs`, or a unique prefix, as
    argparse allows), or a DeploymentError naming what was meant."""
    name = head if not head.startswith("--") else "--" + head[2:].replace("_", "-")
    if name in arity:
        return name
    if name.startswith("--"):
        longer = sorted(f for f in arity if f.startswith(name))
        if len(longer) == 1:
            return longer[0]
        if longer:
            shown = ", ".join(longer[:5]) + (", ..." if len(longer) > 5 else "")
            raise DeploymentError(f"{head}: ambiguous vllm serve flag (could be {shown})")
    close = difflib.get_close_matches(name, list(arity), n=1, cutoff=0.75)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise DeploymentError(f"{head}: unrecognized vllm serve flag{hint}")


def check_serve_argv(argv: list[str]) -> list[str]:
    """`argv` with every flag spelled out in full, or a DeploymentError where
    vllm serve would refuse it: an unknown or ambiguous flag, a missing value,
    a second positional argument. Flags are those of vLLM 0.32, 0.33 and 0.34
    (`outrate.check.vllm_flags_0_32`, `_0_33`, `_0_34`), with vLLM's spellings:
    `--a_b`, `--a=v`, dotted JSON keys (`--kv-transfer-config.kv_connector X`),
    `-O3`."""
    arity = _serve_flag_arity()
    out = argv[:1] if argv[:1] == ["serve"] else []
    i, positionals = len(out), 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("-O") and not arg.startswith("-O."):  # -O3, -O=3, -O 3
            out.append(arg)
            if arg == "-O" and i < len(argv) and argv[i] in ("0", "1", "2", "3"):
                out.append(argv[i])
                i += 1
            continue
        if not arg.startswith("-") or arg == "-" or _NUMBER.fullmatch(arg):
            positionals += 1
            if positionals > 1:
                raise DeploymentError(
                    f"{arg}: unexpected argument (vllm serve takes one positional: the model)"
                )
            out.append(arg)
            continue
        head, eq, value = arg.partition("=")
        name, dot, sub = head.partition(".")
        if name in ("--help", "-h"):
            out.append(arg)
            continue
        flag = _resolve_flag(name, arity)
        out.append(flag + dot + sub + eq + value)
        kind = "1" if dot else arity[flag]
        if eq or kind == "0":
            continue
        if kind == "1":
            if i >= len(argv):
                raise DeploymentError(f"{head}: expects a value")
            out.append(argv[i])
            i += 1
            continue
        start = i
        while i < len(argv) and (not argv[i].startswith("-") or _NUMBER.fullmatch(argv[i])):
            out.append(argv[i])
            i += 1
            if kind == "?":
                break
        if kind == "+" and i == start:
            raise DeploymentError(f"{head}: expects at least one value")
    return out
