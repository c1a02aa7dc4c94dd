"""The policy path in one pass: file -> loader -> Policy -> compiler -> CompiledPolicy.

What the engine, `outrate lint` and the reloader call. It sits above the
loader and the compiler (which never import each other) so each module of
the path imports only the ones below it (tests/test_layers.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from decimal import Decimal
from typing import Any

from outrate.errors import PolicyError, Problem
from outrate.identity.core import KeyTable
from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.keys import load_keys
from outrate.policy.loader import parse_policy_bytes, read_policy_file, validate
from outrate.policy.model import Policy
from outrate.policy.values import UNLIMITED

DEFAULT_FLAG = "--default-user-output-tokens-per-second"
USERS_FLAG = "--user-output-tokens-per-second"


def load_compiled(path: str | os.PathLike[str]) -> CompiledPolicy:
    """Load, validate and compile a policy file (what the engine and lint run)."""
    source = os.fspath(path)
    raw = read_policy_file(source)
    policy = parse_policy_bytes(raw, source)
    sha = hashlib.sha256(raw).hexdigest()
    return compile_policy(policy, source, sha, load_policy_keys(policy, source))


def keys_path(policy: Policy, source: str) -> str | None:
    """The keys file a policy names, resolved against the policy file's directory
    (the path as given, not its symlink target: a ConfigMap's `..data` swap
    moves both files together)."""
    if policy.identity.source != "api_key" or policy.identity.keys is None:
        return None
    base = os.path.dirname(os.path.abspath(source))
    return os.path.normpath(os.path.join(base, os.path.expanduser(policy.identity.keys)))


def load_policy_keys(policy: Policy, source: str) -> KeyTable | None:
    """The keys file's table, or None when the policy uses none. Problems are
    located in the keys file; the policy line that names it is added, so the
    reader sees which policy asked for which file."""
    path = keys_path(policy, source)
    if path is None:
        return None
    try:
        return load_keys(path)
    except PolicyError as e:
        pos = policy.position("identity", "keys") or (1, 1)
        named = Problem(source, pos[0], pos[1], "identity.keys", f"keys file {path} is not usable")
        raise PolicyError([named, *e.problems], depends_on=(path,)) from e


def policy_from_flags(
    default_rate: float | None,
    user_rates: dict[str, float] | str | None,
    source: str = "flags",
) -> CompiledPolicy:
    """The seed's flags as a policy, validated exactly like a file.

    `user_rates` is the JSON of `--user-output-tokens-per-second` (or the parsed
    dict). Without a default flag identified users are unlimited. Errors name the
    flag: `--user-output-tokens-per-second:1:1: users.user-a: must be > 0`.
    """
    if isinstance(user_rates, str):
        try:
            user_rates = json.loads(user_rates, parse_float=Decimal)
        except json.JSONDecodeError as e:
            raise PolicyError(
                [Problem(USERS_FLAG, e.lineno, e.colno, "users", f"invalid JSON: {e.msg}")]
            ) from e
        except RecursionError:  # json.loads recurses once per level of nesting
            message = "invalid JSON: nested too deep"
            raise PolicyError([Problem(USERS_FLAG, 1, 1, "users", message)]) from None
    if user_rates is not None and not isinstance(user_rates, dict):
        raise PolicyError(
            [
                Problem(
                    USERS_FLAG,
                    1,
                    1,
                    "users",
                    "must be a JSON object of user id -> tokens per second",
                )
            ]
        )
    data: dict[str, Any] = {"version": 1}
    data["default"] = UNLIMITED if default_rate is None else default_rate
    if user_rates is not None:
        data["users"] = user_rates

    def flag_for(path: tuple[Any, ...]) -> str:
        return USERS_FLAG if path[:1] == ("users",) else DEFAULT_FLAG

    policy = validate(data, source, file_for=flag_for)
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
    return compile_policy(policy, source, digest)
