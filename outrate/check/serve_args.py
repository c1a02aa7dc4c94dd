"""The `vllm serve` flags and `--config` YAML keys outrate reads, read without vLLM.

Separate from the `Deployment` record (`outrate.check.deployment`) because
this is the part that has to track vLLM's spelling of its inputs, flag by
flag, while the record and the lint rules only see the result: a mapping
from `Deployment` field to (value, where it was set).

Flag names and defaults checked against vLLM 0.32.0 (`vllm/engine/arg_utils.py`,
`vllm/utils/argparse_utils.py`): underscores and dashes are interchangeable in
long flags; `--flag=value` and `--flag value` both work; booleans are
`--x`/`--no-x`; JSON configs also accept dotted keys (`--kv-transfer-config.kv_connector X`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode

from outrate.check.outrate_flags import BY_NAME, STORE, check_value
from outrate.errors import OutrateError, PolicyError
from outrate.fileread import MIB, FileLimit, FileReadError, decode_text, read_bounded
from outrate.policy.compose import check_parse_limits
from outrate.policy.pipeline import USERS_FLAG


class DeploymentError(OutrateError):
    """A deployment description (flags or `--config` file) that cannot be read."""


# -- value converters: str (from argv) or YAML-native (from --config) -> value --


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON ({e.msg})") from e
    return value


def _int(value: Any) -> int:
    # vLLM hands a --config file's 3.0 to argparse as "3.0": int() refuses it
    if isinstance(value, bool | float):
        raise ValueError(f"expected an integer (got {value!r})")
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"expected an integer (got {value!r})") from e


def _model_len(value: Any) -> int | None:
    """`--max-model-len`: a plain number of tokens; vLLM's other spellings
    (`1k`, `-1`, `auto`: from the model) are left to vLLM, as unknown here."""
    try:
        n = _int(value)
    except ValueError:
        return None
    return n if n > 0 else None


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


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number (got {value!r})")
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"expected a number (got {value!r})") from e


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _api_key(value: Any) -> bool:
    """Set or not; the value (a secret) is never read further."""
    if isinstance(value, list | tuple):
        return any(bool(v) for v in value)
    return value is not None and value is not False and value != ""


def _outrate(name: str) -> Callable[[Any], Any]:
    """An `--outrate-*` flag: read as argparse reads it (`FLAGS`' type), then
    the server's own check of its value (`outrate.check.outrate_flags`). The
    store's URL is kept only as present or not: it may carry a password."""
    flag = BY_NAME[name]
    parse: Callable[[Any], Any] = _text
    if flag.type is int:
        parse = _int
    elif flag.type is float:
        parse = _float

    def convert(value: Any) -> Any:
        if name == USERS_FLAG and isinstance(value, dict):  # a --config mapping
            value = json.dumps(value)
        kept = check_value(name, parse(value))
        return bool(kept) if name == STORE else kept

    return convert


def _text(value: Any) -> str:
    return str(value)


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
    "max-model-len": _Flag("max_model_len", _model_len),
    "async-scheduling": _Flag("async_scheduling", boolean=True),
    "diffusion-config": _Flag("model_kind", _diffusion),
    "host": _Flag("host", _str),
    "uds": _Flag("uds", _str),
    "api-key": _Flag("api_key", _api_key),
    "api-server-count": _Flag("api_server_count", _int),
}
OUTRATE_TARGETS = {
    "--outrate-policy": "policy",
    "--outrate-reload": "reload",
    "--outrate-trace": "trace",
    "--outrate-trace-max-bytes": "trace_max_bytes",
    "--outrate-store": "store",
    "--outrate-store-fallback": "store_fallback",
    "--outrate-store-hold-s": "store_hold_s",
    "--outrate-store-engines": "store_engines",
    "--outrate-store-lease-ms": "store_lease_ms",
    "--outrate-quota-file": "quota_file",
    "--default-user-output-tokens-per-second": "default_rate",
    "--user-output-tokens-per-second": "user_rates",
}
"""Every flag of `outrate.check.outrate_flags.FLAGS` -> its `Deployment` field."""
_FLAGS.update({name[2:]: _Flag(field, _outrate(name)) for name, field in OUTRATE_TARGETS.items()})
_SHORT = {
    "sc": "speculative-config",
    "dp": "data-parallel-size",
    "pp": "pipeline-parallel-size",
    "tp": "tensor-parallel-size",
    "asc": "api-server-count",
    "dc": "diffusion-config",
}

Settings = dict[str, tuple[Any, str]]
"""field -> (value, location), merged config-then-argv like vLLM does."""


def _set(out: Settings, name: str, flag: _Flag, raw: Any, where: str) -> None:
    try:
        out[flag.target] = (flag.value(raw), where)
    except ValueError as e:
        if name == where and str(e).startswith(name):  # the message names the flag itself
            raise DeploymentError(str(e)) from e
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


def settings_from_argv(argv: list[str]) -> tuple[Settings, list[str]]:
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


VLLM_CONFIG_FILE = FileLimit("a vLLM config file", 16 * MIB)
"""vLLM's `--config` YAML: a few dozen flags."""


def read_vllm_config(path: str) -> str:
    """The text of a `--config` file, read like every file outrate is handed
    (`outrate.fileread`) and parsed within a policy's nesting and alias
    limits (`check_parse_limits`), so the YAML parses that follow are
    bounded; a DeploymentError located at it if it cannot be."""
    try:
        text = decode_text(read_bounded(path, VLLM_CONFIG_FILE), path)
        check_parse_limits(text, path)
    except (FileReadError, PolicyError) as e:
        raise DeploymentError(str(e)) from e
    return text


def settings_from_config(path: str) -> Settings:
    """vLLM's `--config` YAML: top-level keys are flag names without dashes."""
    text = read_vllm_config(path)
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
