"""A neutral description of a vLLM deployment, read without importing vLLM.

`outrate lint` must say "this engine cannot enforce your policy" before anyone
starts a GPU, so it reads the same inputs `vllm serve` reads (its flags and its
`--config` YAML) with a small parser of its own, keeping only what outrate
cares about, plus where each value came from. The engine integration can build
a `Deployment` from the real `VllmConfig` instead and run the same lint rules.

Flag names and defaults checked against vLLM 0.32.0 (`vllm/engine/arg_utils.py`,
`vllm/utils/argparse_utils.py`): underscores and dashes are interchangeable in
long flags; `--flag=value` and `--flag value` both work; booleans are
`--x`/`--no-x`; JSON configs also accept dotted keys (`--kv-transfer-config.kv_connector X`);
a `--config` file is applied first and command-line flags override it.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode

from outrate.errors import OutrateError


class DeploymentError(OutrateError):
    """A deployment description (flags or `--config` file) that cannot be read."""


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
    async_scheduling: bool | None = None
    store: bool = False
    """`--outrate-store` given: budgets are shared between engines."""
    store_fallback: str | None = None
    """`--outrate-store-fallback` (`share` when unset)."""
    trace: str | None = None
    """`--outrate-trace`, absolute, checked like the server checks it."""
    model_kind: str | None = None
    """"multimodal", "encoder-decoder", "hybrid", "attention-free", "diffusion",
    or None (plain decoder-only text, or unknown from flags alone)."""
    host: str | None = None
    """`--host`; None binds every interface (vLLM's default)."""
    uds: str | None = None
    """`--uds`: a Unix socket instead of TCP (host and port are ignored)."""
    api_key: bool = False
    """vLLM's own `--api-key` is set (the keys themselves are never kept)."""
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


# -- value converters: str (from argv) or YAML-native (from --config) -> value --


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON ({e.msg})") from e
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer (got {value!r})")
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"expected an integer (got {value!r})") from e


def _present(value: Any) -> bool:
    """A JSON/dict config given at all (not null) switches its feature on."""
    return _json(value) is not None


def _key_of(key: str) -> Callable[[Any], str | None]:
    def get(value: Any) -> str | None:
        data = _json(value)
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object (got {value!r})")
        found = data.get(key)
        return None if found is None else str(found)

    return get


def _offload_size(value: Any) -> bool:
    # vLLM turns KV offloading on whenever kv_offloading_size is not None
    # (VllmConfig._post_init_kv_transfer_config), whatever the backend.
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        return False
    try:
        float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"expected a size in GiB (got {value!r})") from e
    return True


def _aux(value: Any) -> bool:
    data = _json(value)
    return isinstance(data, dict) and bool(data.get("enable_return_routed_experts"))


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _api_key(value: Any) -> bool:
    """Set or not; the value (a secret) is never read further."""
    if isinstance(value, list | tuple):
        return any(bool(v) for v in value)
    return value is not None and value is not False and value != ""


def _store_url(value: Any) -> bool:
    """`--outrate-store URL`: checked like the server checks it; only its
    presence is kept (the URL may carry a password)."""
    if value is None or str(value) == "":
        return False
    from outrate.budget.shared.lease import check_url

    check_url(str(value))
    return True


def _trace_path(value: Any) -> str | None:
    """`--outrate-trace PATH`: refused where startup would refuse it."""
    from outrate.observe.trace import check_trace_path

    return None if value is None else str(check_trace_path(str(value)))


def _diffusion(value: Any) -> str | None:
    return "diffusion" if _present(value) else None


class _Flag:
    """One vLLM flag: which Deployment field it sets and how to read its value.

    `boolean` flags take no value (`--x` / `--no-x`); `set_to` is the value a
    bare flag means, for flags like `--spec-model M` that only switch a feature.
    """

    def __init__(
        self,
        target: str,
        convert: Callable[[Any], Any] | None = None,
        *,
        boolean: bool = False,
        set_to: Any = None,
    ) -> None:
        self.target = target
        self.convert = convert
        self.boolean = boolean
        self.set_to = set_to

    def value(self, raw: Any) -> Any:
        if self.set_to is not None:
            return self.set_to
        assert self.convert is not None
        return self.convert(raw)


_FLAGS: dict[str, _Flag] = {
    "speculative-config": _Flag("speculative", _present),
    "spec-method": _Flag("speculative", set_to=True),
    "spec-model": _Flag("speculative", set_to=True),
    "spec-tokens": _Flag("speculative", set_to=True),
    "data-parallel-size": _Flag("data_parallel_size", _int),
    "pipeline-parallel-size": _Flag("pipeline_parallel_size", _int),
    "tensor-parallel-size": _Flag("tensor_parallel_size", _int),
    "kv-transfer-config": _Flag("kv_connector", _key_of("kv_connector")),
    "ec-transfer-config": _Flag("ec_connector", _key_of("ec_connector")),
    "kv-offloading-size": _Flag("kv_offload", _offload_size),
    "enable-return-routed-experts": _Flag("aux_output", boolean=True),
    "aux-output-config": _Flag("aux_output", _aux),
    "scheduler-cls": _Flag("scheduler_cls", _str),
    "max-num-seqs": _Flag("max_num_seqs", _int),
    "max-num-active-seqs": _Flag("max_num_active_seqs", _int),
    "enable-chunked-prefill": _Flag("chunked_prefill", boolean=True),
    "async-scheduling": _Flag("async_scheduling", boolean=True),
    "diffusion-config": _Flag("model_kind", _diffusion),
    "host": _Flag("host", _str),
    "uds": _Flag("uds", _str),
    "api-key": _Flag("api_key", _api_key),
    "outrate-store": _Flag("store", _store_url),
    "outrate-store-fallback": _Flag("store_fallback", _str),
    "outrate-trace": _Flag("trace", _trace_path),
}
_SHORT = {
    "sc": "speculative-config",
    "dp": "data-parallel-size",
    "pp": "pipeline-parallel-size",
    "tp": "tensor-parallel-size",
    "dc": "diffusion-config",
}

Settings = dict[str, tuple[Any, str]]
"""field -> (value, location), merged config-then-argv like vLLM does."""


def _set(out: Settings, name: str, flag: _Flag, raw: Any, where: str) -> None:
    try:
        out[flag.target] = (flag.value(raw), where)
    except ValueError as e:
        prefix = where if name == where else f"{where}: {name}"
        raise DeploymentError(f"{prefix}: {e}") from e


def _nest(sub: str, raw: Any) -> dict[str, Any]:
    """`kv_connector`, X -> {"kv_connector": X}; `a.b`, X -> {"a": {"b": X}}."""
    value: dict[str, Any] = {}
    inner: Any = raw
    for key in reversed(sub.split(".")):
        value = {key: inner}
        inner = value
    return value


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _from_argv(argv: list[str]) -> tuple[Settings, list[str]]:
    """Flags outrate reads, plus any `--config` files named among them.

    Dotted JSON keys are merged per flag and applied after everything else,
    because vLLM appends them as one JSON argument at the end (so they win).
    """
    out: Settings = {}
    configs: list[str] = []
    dotted: dict[str, tuple[_Flag, dict[str, Any], str]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("--") and len(arg) > 2:
            body = arg[2:]
        elif arg.startswith("-") and arg[1:].partition("=")[0] in _SHORT:
            short, eq, rest = arg[1:].partition("=")
            body = _SHORT[short] + eq + rest
        else:
            continue  # positional (the model, or the value of a flag we skip)
        head, eq, value = body.partition("=")
        head, _, sub = head.partition(".")
        name = head.replace("_", "-")
        negated = name.startswith("no-") and name[3:] in _FLAGS
        flag = _FLAGS.get(name[3:] if negated else name)
        where = arg.partition("=")[0]
        if name == "config" or (flag is not None and not (flag.boolean and not sub)):
            if not eq:
                if i >= len(argv):
                    raise DeploymentError(f"{where}: expects a value")
                value, i = argv[i], i + 1
        if name == "config":
            configs.append(value)
        elif flag is None:
            continue  # a flag outrate does not read
        elif flag.boolean and not sub:
            if eq:
                raise DeploymentError(f"{where}: takes no value; use --{name} or --no-{name}")
            out[flag.target] = (not negated, where)
        elif sub:
            _, merged, _ = dotted.setdefault(name, (flag, {}, where))
            _merge(merged, _nest(sub, _json_or_text(value)))
        else:
            _set(out, where, flag, value, where)
    for flag, merged, where in dotted.values():
        _set(out, where, flag, merged, where)
    return out, configs


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _from_config(path: str) -> Settings:
    """vLLM's `--config` YAML: top-level keys are flag names without dashes."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise DeploymentError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise DeploymentError(f"{where}: invalid YAML: {e.problem}") from e
    if root is None:
        return {}
    if not isinstance(root, MappingNode):
        raise DeploymentError(f"{path}:1:1: a vLLM config file must be a mapping of flag names")
    out: Settings = {}
    for knode, vnode in root.value:
        if not isinstance(knode, ScalarNode):
            continue
        name = str(knode.value).replace("_", "-")
        negated = name.startswith("no-") and name[3:] in _FLAGS
        flag = _FLAGS.get(name[3:] if negated else name)
        if flag is None:
            continue
        where = f"{path}:{knode.start_mark.line + 1}:{knode.start_mark.column + 1}"
        value = yaml.safe_load(yaml.serialize(vnode))
        if flag.boolean:
            if not isinstance(value, bool):
                raise DeploymentError(f"{where}: {knode.value}: expected true or false")
            out[flag.target] = (value != negated, where)
        elif isinstance(value, bool) and flag.set_to is None:
            raise DeploymentError(f"{where}: {knode.value}: expected a value, not {value}")
        else:
            _set(out, knode.value, flag, value, where)
    return out


def _build(settings: Settings, source: str) -> Deployment:
    values = {name: value for name, (value, _) in settings.items()}
    where = MappingProxyType({name: loc for name, (_, loc) in settings.items()})
    return Deployment(**values, source=source, locations=where)


def deployment_from_config(path: str | os.PathLike[str]) -> Deployment:
    """Read a `vllm serve --config` YAML file."""
    source = os.fspath(path)
    return _build(_from_config(source), source)


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
    from_argv, argv_configs = _from_argv(argv)
    paths = ([os.fspath(config)] if config is not None else []) + argv_configs
    settings: Settings = {}
    for path in paths:
        settings.update(_from_config(path))
    settings.update(from_argv)
    if argv:
        name = source
    elif paths:
        name = paths[0]
    else:
        name = "defaults"
    return _build(settings, name)


# -- vllm serve's own argument rules -------------------------------------------

_NUMBER = re.compile(r"-\d+(\.\d*)?([eE][-+]?\d+)?|-\.\d+")


def _serve_flag_arity() -> dict[str, str]:
    """Every flag of every supported vLLM -> its arity. Lint cannot know which
    vLLM a deployment runs, so it accepts a flag any of them accepts. A flag
    whose arity differs between versions takes the newer one's."""
    from outrate.check import vllm_flags_0_32, vllm_flags_0_33

    arity: dict[str, str] = {}
    for f in (vllm_flags_0_32, vllm_flags_0_33):
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
    a second positional argument. Flags are those of vLLM 0.32 and 0.33
    (`outrate.check.vllm_flags_0_32`, `_0_33`), with vLLM's spellings: `--a_b`, `--a=v`, dotted
    JSON keys (`--kv-transfer-config.kv_connector X`), `-O3`."""
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
