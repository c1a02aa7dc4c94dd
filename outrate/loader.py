"""YAML text -> `Policy`, with every problem located at its line and column.

PyYAML's `safe_load` forgets where values were and silently keeps the last of
two equal keys, so we compose the node tree ourselves: one walk builds plain
Python data, records the position of every value and key, and reports
duplicate keys. Pydantic then validates the data against `outrate.policy`, and
its error locations (tuples like `("users", "alice", "rate")`) are mapped back
to those positions. All problems of a file are reported together, in file order.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from outrate.errors import PolicyError, Problem
from outrate.policy import Policy, _shown, unknown_tier
from outrate.policy_file import decode_policy_bytes, read_policy_file

__all__ = ["field_path", "load_policy", "parse_policy", "parse_policy_bytes", "read_policy_file"]

Path = tuple[Any, ...]
Pos = tuple[int, int]

MAX_NODES = 2_000_000
"""Aliases can expand a small file into a huge tree ("billion laughs")."""

_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_STR = "tag:yaml.org,2002:str"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"
# YAML 1.1 (PyYAML) reads `1e6` as a string; YAML 1.2 and humans read a number.
_EXP_NUMBER = re.compile(r"[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)[eE][-+]?\d+")
_DECIMAL = re.compile(r"[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][-+]?\d+)?")

_MISSING = {
    "version": "missing; a policy file starts with 'version: 1'",
    "default": "missing; say what identified users not listed get "
    "(a number of tokens per second or 'unlimited')",
    "pattern": "missing; each match entry needs a 'pattern'",
    "rate": "missing; a tier needs a 'rate' (tokens per second or 'unlimited')",
}


class _Doc:
    """Plain data plus where each piece of it was written."""

    def __init__(self) -> None:
        self.pos: dict[Path, Pos] = {}
        self.keypos: dict[Path, Pos] = {}
        self.problems: list[tuple[Path, Pos, str]] = []
        self.voided: set[Path] = set()
        """Paths whose value we replaced by None after reporting it: validation
        errors under them would only repeat the same problem."""

    def nearest(self, loc: Path) -> Path:
        """The longest prefix of `loc` that exists in the file.

        `alice: 0` is validated as `{rate: 0}`; its error says `users.alice.rate`
        but the file only has `users.alice`, and that is where we point.
        """
        loc = tuple(loc)
        while loc and loc not in self.pos:
            loc = loc[:-1]
        return loc


def _mark(node: Node) -> Pos:
    return node.start_mark.line + 1, node.start_mark.column + 1


class _Walker:
    """Turns composed YAML nodes into data, recording positions as it goes."""

    def __init__(self, loader: yaml.SafeLoader, doc: _Doc) -> None:
        self.loader = loader
        self.doc = doc
        self.count = 0
        self.stack: set[int] = set()

    def walk(self, node: Node, path: Path) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise _TooBig(node)
        self.doc.pos[path] = _mark(node)
        if isinstance(node, ScalarNode):
            return self._scalar(node)
        if id(node) in self.stack:
            self.doc.problems.append((path, _mark(node), "an alias refers to itself"))
            self.doc.voided.add(path)
            return None
        self.stack.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                if node.tag != _SEQ:
                    return self._bad_tag(node, path)
                return [self.walk(item, (*path, i)) for i, item in enumerate(node.value)]
            if isinstance(node, MappingNode):
                if node.tag != _MAP:
                    return self._bad_tag(node, path)
                return self._mapping(node, path)
        finally:
            self.stack.discard(id(node))
        raise AssertionError(f"unexpected YAML node {node!r}")  # pragma: no cover

    def _bad_tag(self, node: Node, path: Path) -> None:
        self.doc.problems.append((path, _mark(node), f"unsupported YAML tag {node.tag!r}"))
        self.doc.voided.add(path)

    def _scalar(self, node: ScalarNode, key: bool = False) -> Any:
        text = node.value
        if node.tag == _FLOAT and _DECIMAL.fullmatch(text):
            return Decimal(text.replace("_", ""))  # exact: 0.1 is one tenth
        if not key and node.tag == _STR and not node.style and _EXP_NUMBER.fullmatch(text):
            return Decimal(text.replace("_", ""))  # a value; a key `1e5` stays a name
        return self.loader.construct_object(node, deep=True)

    def _mapping(self, node: MappingNode, path: Path) -> dict[Any, Any]:
        first: dict[Any, Pos] = {}
        for knode, _ in node.value:  # duplicates among keys written here
            if isinstance(knode, ScalarNode) and knode.tag != _MERGE:
                key = self._scalar(knode, key=True)
                if _hashable(key) and key in first:
                    line = first[key][0]
                    self.doc.problems.append(
                        (path, _mark(knode), f"duplicate key {_shown(key)} (first at line {line})")
                    )
                elif _hashable(key):
                    first[key] = _mark(knode)
        if any(k.tag == _MERGE for k, _ in node.value):
            self.loader.flatten_mapping(node)  # `<<: *base`; later keys override
        out: dict[Any, Any] = {}
        for knode, vnode in node.value:
            key = self._scalar(knode, key=True) if isinstance(knode, ScalarNode) else None
            if not isinstance(knode, ScalarNode) or not _hashable(key):
                self.doc.problems.append((path, _mark(knode), "keys must be plain scalars"))
                continue
            self.doc.keypos[(*path, key)] = _mark(knode)
            out[key] = self.walk(vnode, (*path, key))
        return out


class _TooBig(Exception):
    def __init__(self, node: Node) -> None:
        self.node = node


def _hashable(key: object) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


_FAST_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml when PyYAML has it: 3-4x faster on big user lists. Its error
messages differ (and say less), so a file that fails is re-read by the pure
Python parser: the messages are then the same on every install."""


def _yaml_problem(e: yaml.MarkedYAMLError, source: str) -> Problem:
    mark = e.problem_mark or e.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    problem = e.problem or e.context or "cannot parse"
    if e.problem and e.context and e.context_mark is not None:
        problem += f" ({e.context} at line {e.context_mark.line + 1})"
    return Problem(source, line, col, "<root>", f"invalid YAML: {problem}")


def _compose(
    text: str, source: str, loader_cls: type[yaml.SafeLoader] | None = None
) -> tuple[Any, _Doc]:
    """Parse YAML into (data, positions); syntax errors become a PolicyError."""
    doc = _Doc()
    loader_cls = loader_cls or _FAST_LOADER
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
        if node is None:
            expected = "empty policy; expected a mapping with 'version: 1' and 'default'"
            raise PolicyError([Problem(source, 1, 1, "<root>", expected)])
        data = _Walker(loader, doc).walk(node, ())
    except yaml.MarkedYAMLError as e:
        if loader_cls is not yaml.SafeLoader:
            return _compose(text, source, yaml.SafeLoader)
        raise PolicyError([_yaml_problem(e, source)]) from e
    except yaml.YAMLError as e:  # pragma: no cover - every PyYAML error we know is marked
        raise PolicyError([Problem(source, 1, 1, "<root>", f"invalid YAML: {e}")]) from e
    except _TooBig as e:
        line, col = _mark(e.node)
        message = f"more than {MAX_NODES} values (alias bomb?)"
        raise PolicyError([Problem(source, line, col, "<root>", message)]) from None
    finally:
        loader.dispose()
    return data, doc


# -- error translation ------------------------------------------------------

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_\-/@+:*?]+")


def field_path(path: Path) -> str:
    """`("match", 1, "pattern")` -> `match[1].pattern`; `()` -> `<root>`."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            text = str(part)
            text = text if _PLAIN_KEY.fullmatch(text) else json.dumps(text)
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


def _model_at(path: Path) -> type[BaseModel] | None:
    """The model that validates the mapping at `path` (for 'did you mean')."""
    tp: Any = Policy
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


def _unknown_key(parent: Path, key: object) -> str:
    if len(parent) == 2 and parent[0] == "tiers" and key == "tier":
        return "unknown key 'tier': a tier cannot refer to another tier; give it a 'rate'"
    text = f"unknown key {_shown(key)}"
    model = _model_at(parent)
    if model is not None and isinstance(key, str):
        close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
        if close:
            text += f" (did you mean '{close[0]}'?)"
    return text


def _message(err: Any) -> str:
    kind = err["type"]
    if kind == "outrate":
        return str(err["msg"])
    got = _shown(err.get("input"))
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping (got {got})"
    if kind in ("list_type", "tuple_type"):
        return f"must be a list (got {got})"
    msg = str(err["msg"])
    return msg[:1].lower() + msg[1:]


def _translate(err: ValidationError, doc: _Doc) -> list[tuple[Path, Pos, str, str]]:
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
        loc, kind = tuple(e["loc"]), e["type"]
        if kind == "missing" and loc[:-1] in tier_in_tier:
            continue
        if loc and loc[-1] == "[key]":  # a bad user id or tier name
            where = loc[:-1]
            pos = doc.keypos.get(where) or doc.pos.get(doc.nearest(where), (1, 1))
            out.append((where, pos, field_path(loc[:-2]), _message(e)))
        elif kind in ("extra_forbidden", "invalid_key"):
            pos = doc.keypos.get(loc) or doc.pos.get(doc.nearest(loc), (1, 1))
            out.append((loc, pos, field_path(loc[:-1]), _unknown_key(loc[:-1], loc[-1])))
        elif kind == "missing":
            parent = loc[:-1]
            pos = doc.pos.get(parent, (1, 1)) if parent else (1, 1)
            out.append((loc, pos, field_path(loc), _MISSING.get(str(loc[-1]), "missing")))
        else:
            where = doc.nearest(loc)
            pos = doc.pos.get(where, (1, 1)) if where else (1, 1)
            out.append((where, pos, field_path(where), _message(e)))
    return out


def _tier_references(data: dict[Any, Any], doc: _Doc) -> list[tuple[Path, Pos, str, str]]:
    """Undefined tiers, found on the raw data so they are reported together with
    every other problem (a pydantic model validator runs only on valid fields)."""
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
        if isinstance(name, str) and name and name not in tiers:
            where = (*path, "tier")
            pos = doc.pos.get(where, (1, 1))
            out.append((where, pos, field_path(where), unknown_tier(name, tiers)))
    return out


def validate(
    data: Any,
    source: str,
    doc: _Doc | None = None,
    file_for: Callable[[Path], str] | None = None,
) -> Policy:
    """Validate plain data (from YAML or from flags) into a `Policy`.

    `doc` holds positions (YAML); without it every problem is at 1:1 of
    `file_for(field path)`, which is how flags name themselves in errors.
    """
    if doc is None:
        doc = _Doc()
        _positions_of(data, (), doc)
    name = file_for or (lambda _path: source)
    found: list[tuple[Path, Pos, str, str]] = [
        (path, pos, field_path(path), msg) for path, pos, msg in doc.problems
    ]
    policy: Policy | None = None
    cause: ValidationError | None = None
    if not isinstance(data, dict):
        expected = "must be a mapping with 'version: 1' and 'default'"
        found.append(((), (1, 1), "<root>", f"{expected} (got {_shown(data)})"))
    else:
        found += _tier_references(data, doc)
        try:
            policy = Policy.model_validate(data, context={"tiers_checked": True})
        except ValidationError as e:
            found += [
                item
                for item in _translate(e, doc)
                if not any(item[0][: len(v)] == v for v in doc.voided)
            ]
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


def _positions_of(data: Any, path: Path, doc: _Doc) -> None:
    doc.pos[path] = (1, 1)
    if isinstance(data, dict):
        for key, value in data.items():
            doc.keypos[(*path, key)] = (1, 1)
            _positions_of(value, (*path, key), doc)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _positions_of(value, (*path, i), doc)


def parse_policy(text: str, source: str) -> Policy:
    """Parse and validate policy text; `source` names it in error messages."""
    data, doc = _compose(text, source)
    return validate(data, source, doc)


def parse_policy_bytes(raw: bytes, source: str) -> Policy:
    """Decode (UTF-8, optional BOM), parse and validate a policy file's bytes."""
    return parse_policy(decode_policy_bytes(raw, source), source)


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate a policy file. Every failure is a PolicyError."""
    return parse_policy_bytes(read_policy_file(path), os.fspath(path))
