"""The `--outrate-*` flags of `vllm serve`, checked in one place.

`outrate lint` promises to refuse what the server refuses at start. Both run
these checks: the server (vllm_integration/common/config.py) on argparse's
values, lint (outrate/check/serve_args.py) on the text of its argv or a
`--config` file, parsed as argparse would. `FLAGS` holds each flag's type,
its choices and its value check; `check_flags_together` the rules between
flags (a store flag without a store, a policy file beside the in-memory
policy's flags). The plugin (vllm_integration/startup/plugin.py) declares
its arguments with `FLAGS`' types and choices, and a test walks every flag
with a bad value through lint and the server's parser.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from outrate.budget.shared.credit import DEPRECATED_FALLBACKS, FALLBACKS, fallback_named
from outrate.budget.shared.lease import check_url
from outrate.errors import OutrateError, PolicyError
from outrate.observe.tracefile import check_trace_path, rank_path
from outrate.policy.pipeline import DEFAULT_FLAG, USERS_FLAG, policy_from_flags

POLICY = "--outrate-policy"
RELOAD = "--outrate-reload"
TRACE = "--outrate-trace"
TRACE_MAX_BYTES = "--outrate-trace-max-bytes"
STORE = "--outrate-store"
STORE_FALLBACK = "--outrate-store-fallback"
STORE_HOLD_S = "--outrate-store-hold-s"
STORE_ENGINES = "--outrate-store-engines"
STORE_LEASE_MS = "--outrate-store-lease-ms"
QUOTA_FILE = "--outrate-quota-file"

RELOAD_MODES = ("watch", "poll", "off")
FALLBACK_NAMES = (*FALLBACKS, *DEPRECATED_FALLBACKS)
"""What `--outrate-store-fallback` takes (`share` is the old name of `pause`)."""
HOLD_S = (1, 3600)
ENGINES = (1, 4096)
LEASE_MS = (1, 1000)


class FlagError(OutrateError):
    """A flag the server refuses at start; the message names it."""


def _in(lo: int, hi: int) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        # `not lo <= value <= hi` also refuses nan
        if not lo <= value <= hi:
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            raise ValueError(f"must be in {lo}..{hi}, got {shown}")
        return value

    return check


def _at_least_one(value: int) -> int:
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def _fallback(value: str) -> str:
    fallback_named(value)  # ValueError: none of them
    return value


def _store_url(value: str) -> str:
    if value:
        check_url(value)
    return value


def _trace(value: str) -> str:
    try:
        return str(check_trace_path(value))
    except OutrateError as e:
        raise ValueError(str(e)) from e


def _quota_file(value: str) -> str:
    """Where quota usage is kept across restarts: a file in a directory that
    exists (the engine writes it there atomically, by renaming)."""
    if not value:
        raise ValueError("must name a file")
    path = os.path.abspath(value)
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory; name a file in it")
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"{path}: its directory does not exist")
    return path


def _default_rate(value: float) -> float:
    _seed_policy(value, None)
    return value


def _user_rates(value: Any) -> Any:
    _seed_policy(None, value)
    return value


def _seed_policy(default: float | None, users: Any) -> None:
    """The in-memory policy's flags, validated as the server compiles them
    (its messages name the flag: `--user-output-tokens-per-second:1:1: ...`)."""
    try:
        policy_from_flags(default, users)
    except PolicyError as e:
        raise ValueError(str(e)) from e


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Flag:
    """One flag: what argparse makes of its text, and what the server accepts."""

    name: str
    type: Callable[[str], Any]
    """argparse's `type=`: int, float or str."""
    check: Callable[[Any], Any] = _same
    """Raises ValueError with what is wrong (`must be in 1..4096, got 0`)."""
    choices: tuple[str, ...] | None = None
    needs: str | None = None
    """A flag this one means nothing without."""

    @property
    def dest(self) -> str:
        """The attribute argparse sets: `outrate_store_engines`."""
        return self.name[2:].replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag(POLICY, str),
    Flag(RELOAD, str, _one_of(RELOAD_MODES), RELOAD_MODES),
    Flag(TRACE, str, _trace),
    Flag(TRACE_MAX_BYTES, int, _at_least_one, needs=TRACE),
    Flag(STORE, str, _store_url),
    Flag(STORE_FALLBACK, str, _fallback, FALLBACK_NAMES, needs=STORE),
    Flag(STORE_HOLD_S, float, _in(*HOLD_S), needs=STORE),
    Flag(STORE_ENGINES, int, _in(*ENGINES), needs=STORE),
    Flag(STORE_LEASE_MS, int, _in(*LEASE_MS), needs=STORE),
    Flag(QUOTA_FILE, str, _quota_file),
    Flag(DEFAULT_FLAG, float, _default_rate),
    Flag(USERS_FLAG, str, _user_rates),
)
BY_NAME: Mapping[str, Flag] = {f.name: f for f in FLAGS}


def check_value(name: str, value: Any) -> Any:
    """`value` (already of the flag's type) as the server keeps it, or a
    ValueError saying what is wrong with it."""
    return BY_NAME[name].check(value)


def given(value: Any) -> bool:
    """Set at all: not None, and not an empty URL or path."""
    return value is not None and value != "" and value is not False


def check_flags_together(values: Mapping[str, Any], data_parallel_size: int = 1) -> None:
    """The rules between flags; `values`: flag name -> value (absent or None:
    not given). Raises FlagError."""
    missing: dict[str, list[str]] = {}
    for flag in FLAGS:
        if flag.needs and given(values.get(flag.name)) and not given(values.get(flag.needs)):
            missing.setdefault(flag.needs, []).append(flag.name)
    for needed, names in missing.items():
        verb = "needs" if len(names) == 1 else "need"
        raise FlagError(f"{_listed(names)} {verb} {needed}")
    seed = given(values.get(DEFAULT_FLAG)) or given(values.get(USERS_FLAG))
    if given(values.get(POLICY)) and seed:
        raise FlagError(
            f"{POLICY} cannot be combined with {DEFAULT_FLAG} or {USERS_FLAG}: put those "
            "limits in the policy file"
        )
    trace = values.get(TRACE)
    if given(trace) and data_parallel_size > 1:  # each rank writes a file of its own
        for rank in range(data_parallel_size):
            try:
                check_trace_path(rank_path(str(check_trace_path(str(trace))), f".dp{rank}"))
            except OutrateError as e:
                raise FlagError(f"{TRACE}: {e}") from e


def check_flags(values: Mapping[str, Any], data_parallel_size: int = 1) -> dict[str, Any]:
    """Every value check, then the rules between flags: what the server runs
    at start. Returns the values as kept (the trace path made absolute).
    Raises FlagError: `--outrate-store-engines must be in 1..4096, got 0`."""
    kept = dict(values)
    for flag in FLAGS:
        value = values.get(flag.name)
        if value is None:
            continue
        try:
            kept[flag.name] = flag.check(value)
        except ValueError as e:
            raise FlagError(_said(flag.name, str(e))) from e
    check_flags_together(kept, data_parallel_size)
    return kept


def _said(name: str, message: str) -> str:
    """`--flag must be ...`; `--flag: PATH: why` for a message that starts with
    a location; a message that names the flag itself as it is."""
    if message.startswith(name):
        return message
    return f"{name} {message}" if message.startswith("must ") else f"{name}: {message}"


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
