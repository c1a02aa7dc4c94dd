"""YAML text -> `Policy`, with every problem located at its line and column.

`outrate.policy.compose` turns the text into plain data and the position of every
value and key (within limits: depth, alias expansion). Pydantic then validates
the data against `outrate.policy.model`, and its error locations (tuples like
`("users", "alice", "rate")`) are mapped back to those positions. All problems
of a file are reported together, in file order.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from outrate.errors import PolicyError, Problem
from outrate.policy.compose import Doc, Path, Pos, compose
from outrate.policy.file import decode_policy_bytes, read_policy_file
from outrate.policy.model import Policy, unknown_tier
from outrate.policy.specs import peak_problem
from outrate.policy.values import MAX_NAME_LEN, must_be_string, parse_rate, shown

__all__ = ["field_path", "load_policy", "parse_policy", "parse_policy_bytes", "read_policy_file"]

_MISSING = {
    "version": "missing; a policy file starts with 'version: 1'",
    "default": "missing; say what identified users not listed get "
    "(a number of tokens per second or 'unlimited')",
    "pattern": "missing; each match entry needs a 'pattern'",
    "rate": "missing; a tier needs a 'rate' (tokens per second or 'unlimited')",
}
_MISSING_PROMPT_RATE = (
    "missing; a prompt limit needs a 'rate' (prompt tokens per second or 'unlimited')"
)


# -- error translation ------------------------------------------------------

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-/@+:*?]+")


def field_path(path: Path) -> str:
    """`("match", 1, "pattern")` -> `match[1].pattern`; `()` -> `<root>`.

    Names longer than 40 characters are cut (`"aaa..."`): the line and column
    say exactly where, and a 1 MB name must not make a 1 MB error line."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            text = str(part)
            if len(text) > 40:
                text = json.dumps(text[:37] + "...")
            elif not _PLAIN_KEY.fullmatch(text):
                text = json.dumps(text)
            out += f".{text}" if out else text
    return out or "<root>"


def _unwrap(tp: Any) -> Any:
    """Strip Annotated / Optional so we can walk the model's structure."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, type(int | None)):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def model_at(root: type[BaseModel], path: Path) -> type[BaseModel] | None:
    """The model under `root` that validates the mapping at `path` (for
    'did you mean'; the workload reader asks it too)."""
    tp: Any = root
    for part in path:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return None
            tp = field.annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) in (list, tuple):
            tp = typing.get_args(tp)[0]
        else:
            return None
    tp = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unknown_key(parent: Path, key: object, written: str | None = None) -> str:
    """`written`: the author's spelling of a key YAML did not read as text."""
    if len(parent) == 2 and parent[0] == "tiers" and key == "tier":
        return "unknown key 'tier': a tier cannot refer to another tier; give it a 'rate'"
    text = f"unknown key {written if written is not None else shown(key)}"
    return text + did_you_mean(Policy, parent, key)


def did_you_mean(root: type[BaseModel], parent: Path, key: object) -> str:
    """` (did you mean 'rate'?)` for a key close to one the model at `parent`
    has, else ""."""
    model = model_at(root, parent)
    if model is not None and isinstance(key, str):
        close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
        if close:
            return f" (did you mean '{close[0]}'?)"
    return ""


def type_message(err: Any) -> str:
    """A pydantic error other than outrate's own, in outrate's words."""
    got = shown(err.get("input"))
    kind = err["type"]
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping (got {got})"
    if kind in ("list_type", "tuple_type"):
        return f"must be a list (got {got})"
    msg = str(err["msg"])
    return msg[:1].lower() + msg[1:]


def _message(err: Any, doc: Doc, where: Path) -> str:
    kind = err["type"]
    if kind == "outrate":
        quote = (err.get("ctx") or {}).get("quote")
        written = doc.written.get(where)
        if quote and written is not None:  # the hint in the author's own spelling
            return must_be_string(quote, written)
        return str(err["msg"])
    return type_message(err)


def _translate(err: ValidationError, doc: Doc) -> list[tuple[Path, Pos, str, str]]:
    """Pydantic errors -> (field path, position, field text, message)."""
    out = []
    errors = err.errors()
    # `pro: {tier: free}` under tiers is one mistake, not also a missing rate.
    tier_in_tier = {
        tuple(e["loc"][:-1])
        for e in errors
        if e["type"] == "extra_forbidden"
        and len(e["loc"]) == 3
        and e["loc"][0] == "tiers"
        and e["loc"][2] == "tier"
    }
    for e in errors:
        loc, kind = doc.real_path(tuple(e["loc"])), e["type"]
        if kind == "missing" and loc[:-1] in tier_in_tier:
            continue
        if loc and loc[-1] == "[key]":  # a bad user id or tier name, at the key itself
            where = loc[:-1]
            pos = doc.keypos.get(where) or doc.pos.get(doc.nearest(where), (1, 1))
            out.append((where, pos, field_path(loc[:-2]), _message(e, doc, loc)))
        elif kind in ("extra_forbidden", "invalid_key"):
            pos = doc.keypos.get(loc) or doc.pos.get(doc.nearest(loc), (1, 1))
            written = doc.written.get((*loc, "[key]"))
            out.append((loc, pos, field_path(loc[:-1]), _unknown_key(loc[:-1], loc[-1], written)))
        elif kind == "missing":
            parent = loc[:-1]
            pos = doc.pos.get(parent, (1, 1)) if parent else (1, 1)
            text = _MISSING.get(str(loc[-1]), "missing")
            if loc[-2:] == ("prompt", "rate"):
                text = _MISSING_PROMPT_RATE
            out.append((loc, pos, field_path(loc), text))
        else:
            where = doc.nearest(loc)
            pos = doc.pos.get(where, (1, 1)) if where else (1, 1)
            out.append((where, pos, field_path(where), _message(e, doc, where)))
    return out


def _tier_references(data: dict[Any, Any], doc: Doc) -> list[tuple[Path, Pos, str, str]]:
    """Undefined tiers, and a `peak` below the rate of the tier beside it, found
    on the raw data so they are reported together with every other problem (a
    pydantic model validator runs only on valid fields)."""
    tiers = data.get("tiers", {})
    if not isinstance(tiers, dict):
        return []
    specs: list[tuple[Path, Any]] = [(("default",), data.get("default"))]
    specs.append((("anonymous",), data.get("anonymous")))
    users = data.get("users")
    if isinstance(users, dict):
        specs += [(("users", uid), spec) for uid, spec in users.items()]
    match = data.get("match")
    if isinstance(match, list):
        specs += [(("match", i), spec) for i, spec in enumerate(match)]
    out = []
    for path, spec in specs:
        if not isinstance(spec, dict):
            continue
        name = spec.get("tier")
        if isinstance(name, str) and 0 < len(name) <= MAX_NAME_LEN and name not in tiers:
            where = (*path, "tier")
            pos = doc.pos.get(where, (1, 1))
            out.append((where, pos, field_path(where), unknown_tier(name, tiers)))
        elif isinstance(name, str) and "peak" in spec:
            bad = _tier_peak(spec["peak"], tiers.get(name), name)
            if bad is not None:
                where = (*path, "peak")
                out.append((where, doc.pos.get(where, (1, 1)), field_path(where), bad))
    return out


def _tier_peak(peak: Any, tier: Any, name: str) -> str | None:
    """What is wrong with `peak` above the rate of tier `name` (raw data), if
    both are valid values; a bad one is reported where it was written."""
    rate = tier.get("rate") if isinstance(tier, dict) else tier
    try:
        return peak_problem(parse_rate(rate), parse_rate(peak), name)
    except ValueError:
        return None


def validate(
    data: Any,
    source: str,
    doc: Doc | None = None,
    file_for: Callable[[Path], str] | None = None,
) -> Policy:
    """Validate plain data (from YAML or from flags) into a `Policy`.

    `doc` holds positions (YAML); without it every problem is at 1:1 of
    `file_for(field path)`, which is how flags name themselves in errors.
    """
    if doc is None:
        doc = Doc()
        _positions_of(data, (), doc)
    name = file_for or (lambda _path: source)
    found: list[tuple[Path, Pos, str, str]] = [
        (path, pos, field_path(path), msg) for path, pos, msg in doc.problems
    ]
    policy: Policy | None = None
    cause: ValidationError | None = None
    if not isinstance(data, dict):
        expected = "must be a mapping with 'version: 1' and 'default'"
        found.append(((), (1, 1), "<root>", f"{expected} (got {shown(data)})"))
    else:
        found += _tier_references(data, doc)
        try:
            policy = Policy.model_validate(data, context={"tiers_checked": True})
        except ValidationError as e:
            found += [item for item in _translate(e, doc) if not doc.is_voided(item[0])]
            cause = e
    if not found and policy is not None:
        policy._positions = dict(doc.pos)
        policy._source = source
        return policy
    problems = sorted(
        {Problem(name(path), pos[0], pos[1], text, msg) for path, pos, text, msg in found},
        key=lambda p: (p.path, p.line, p.col, p.field, p.message),
    )
    raise PolicyError(problems) from cause


def _positions_of(data: Any, path: Path, doc: Doc) -> None:
    """Every path at 1:1 (data from flags has no lines). Iterative: flags JSON
    may nest as deep as json.loads allows, near Python's recursion limit."""
    todo = [(path, data)]
    while todo:
        path, data = todo.pop()
        doc.pos[path] = (1, 1)
        if isinstance(data, dict):
            for key, value in data.items():
                doc.keypos[(*path, key)] = (1, 1)
                todo.append(((*path, key), value))
        elif isinstance(data, list):
            todo += [((*path, i), value) for i, value in enumerate(data)]


def parse_policy(text: str, source: str) -> Policy:
    """Parse and validate policy text; `source` names it in error messages."""
    data, doc = compose(text, source)
    return validate(data, source, doc)


def parse_policy_bytes(raw: bytes, source: str) -> Policy:
    """Decode (UTF-8, optional BOM), parse and validate a policy file's bytes."""
    return parse_policy(decode_policy_bytes(raw, source), source)


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate a policy file. Every failure is a PolicyError."""
    return parse_policy_bytes(read_policy_file(path), os.fspath(path))
