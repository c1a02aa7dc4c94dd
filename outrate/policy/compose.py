"""YAML text -> plain data plus the position of every value and key, within limits.

PyYAML's `safe_load` forgets where values were and silently keeps the last of
two equal keys, so we compose the node tree ourselves: one walk builds plain
Python data, records the position of every value and key, and reports
duplicate keys. The loader validates the data and maps errors back to the
positions.

A policy file comes from people and tools we do not control and is parsed by
the engine that serves every user, so parsing has hard limits (nesting depth,
alias expansion: `outrate.policy.parse_limits`), each reported here at the line
and column where it was crossed. Which scalar spellings are refused (YAML 1.1's
`0x10`, `1:30`, `1e-400`) is `outrate.policy.scalars`.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, cast

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from outrate.errors import PolicyError, Problem
from outrate.policy.parse_limits import (
    MAX_ALIAS_VALUES,
    MAX_DEPTH,
    PURE_REREAD_MAX_BYTES,
    PureLoader,
    TooBig,
    TooDeep,
    check_depth,
)
from outrate.policy.scalars import STR_TAG, BadScalar, read_scalar, shown_text
from outrate.policy.values import shown

__all__ = ["FAST_LOADER", "Doc", "Path", "Pos", "PureLoader", "check_parse_limits", "compose"]
"""`PureLoader` is the parse limits' parser, named here beside `FAST_LOADER`:
the two parsers `compose` may run."""

Path = tuple[Any, ...]
Pos = tuple[int, int]

_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_MERGE = "tag:yaml.org,2002:merge"
_VALUE = "tag:yaml.org,2002:value"


class Doc:
    """Plain data plus where each piece of it was written."""

    def __init__(self) -> None:
        self.pos: dict[Path, Pos] = {}
        self.keypos: dict[Path, Pos] = {}
        self.problems: list[tuple[Path, Pos, str]] = []
        self.voided: set[Path] = set()
        """Paths whose value we replaced by None after reporting it: validation
        errors under them would only repeat the same problem."""
        self.written: dict[Path, str] = {}
        """How a key or a value that YAML did not read as text was spelled
        (`0x10`, `on`, `~`; cut at 40 characters), for hints; keys under
        `(*path, "[key]")`."""
        self.loc_keys: dict[Path, Any] = {}
        """pydantic names a non-text key in error locations by its repr
        (`"Decimal('1.5')"`): (parent, that name) -> the key itself."""

    def is_voided(self, path: Path) -> bool:
        """Whether `path` lies under a value already reported and voided."""
        return any(path[: len(v)] == v for v in self.voided)

    def nearest(self, loc: Path) -> Path:
        """The longest prefix of `loc` that exists in the file.

        `alice: 0` is validated as `{rate: 0}`; its error says `users.alice.rate`
        but the file only has `users.alice`, and that is where we point.
        """
        loc = tuple(loc)
        while loc and loc not in self.pos:
            loc = loc[:-1]
        return loc

    def real_path(self, loc: Path) -> Path:
        """A pydantic error location with its keys as the file has them."""
        out: Path = ()
        for part in loc:
            path = (*out, part)
            out = path if path in self.pos else (*out, self.loc_keys.get(path, part))
        return out


def _loc_name(key: Any) -> Any:
    """How pydantic names a dict key in an error location: non-text keys by
    their repr, and text as UTF-8 (a lone surrogate becomes U+FFFD)."""
    if isinstance(key, bool):
        return int(key)
    if isinstance(key, str):
        try:
            key.encode()
        except UnicodeEncodeError:
            return key.encode(errors="surrogatepass").decode(errors="replace")
        return key
    if isinstance(key, int):
        return key
    return repr(key)


def mark(node: Node) -> Pos:
    return node.start_mark.line + 1, node.start_mark.column + 1


class _Walker:
    """Turns composed YAML nodes into data, recording positions as it goes.

    Work is bounded: collections deeper than `MAX_DEPTH` (aliases included)
    and more than `MAX_ALIAS_VALUES` values beyond the file's own are refused.
    A collection walked a second time (through an alias or a merge) is a
    repeat, and so is everything inside it and every pair a merge copies.
    """

    def __init__(self, loader: yaml.SafeLoader, doc: Doc) -> None:
        self.loader = loader
        self.doc = doc
        self.own = 0
        self.repeats = 0
        self.seen: set[int] = set()
        self.stack: set[int] = set()
        self.flat: dict[int, list[tuple[Node, Node]]] = {}

    def _count(self, repeat_at: Path | None) -> None:
        if repeat_at is None:
            self.own += 1
            return
        self.repeats += 1
        if self.repeats > MAX_ALIAS_VALUES + self.own:
            raise TooBig(repeat_at)

    def walk(self, node: Node, path: Path, repeat_at: Path | None = None) -> Any:
        """`repeat_at`: where the repeated collection we are inside was used."""
        self.doc.pos[path] = mark(node)
        if isinstance(node, ScalarNode):
            self._count(repeat_at)
            try:
                value = read_scalar(self.loader, node)
            except BadScalar as e:
                self.doc.problems.append((path, mark(node), str(e)))
                self.doc.voided.add(path)
                return None
            if isinstance(value, bool) or not isinstance(value, str | int | Decimal):
                self.doc.written[path] = shown_text(node.value)
            return value
        if id(node) in self.stack:
            self.doc.problems.append((path, mark(node), "an alias refers to itself"))
            self.doc.voided.add(path)
            return None
        if len(path) >= MAX_DEPTH:
            raise TooDeep(node.start_mark)
        if repeat_at is None and id(node) in self.seen:
            repeat_at = path
        self.seen.add(id(node))
        self._count(repeat_at)
        self.stack.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                if node.tag != _SEQ:
                    return self._bad_tag(node, path)
                return [self.walk(item, (*path, i), repeat_at) for i, item in enumerate(node.value)]
            if isinstance(node, MappingNode):
                if node.tag != _MAP:
                    return self._bad_tag(node, path)
                return self._mapping(node, path, repeat_at)
        finally:
            self.stack.discard(id(node))
        raise AssertionError(f"unexpected YAML node {node!r}")  # pragma: no cover

    def _bad_tag(self, node: Node, path: Path) -> None:
        self.doc.problems.append((path, mark(node), f"unsupported YAML tag {node.tag!r}"))
        self.doc.voided.add(path)

    def _key(self, knode: Node) -> tuple[bool, Any]:
        """(usable, key) of a mapping key node."""
        if not isinstance(knode, ScalarNode):
            return False, None
        try:
            key = read_scalar(self.loader, knode, key=True)
        except BadScalar:
            return False, None
        return _hashable(key), key

    def _mapping(self, node: MappingNode, path: Path, repeat_at: Path | None) -> dict[Any, Any]:
        first: dict[Any, Pos] = {}
        for knode, _ in node.value:  # duplicates among keys written here
            if isinstance(knode, ScalarNode) and knode.tag != _MERGE:
                usable, key = self._key(knode)
                if usable and key in first:
                    line = first[key][0]
                    self.doc.problems.append(
                        (path, mark(knode), f"duplicate key {shown(key)} (first at line {line})")
                    )
                elif usable:
                    first[key] = mark(knode)
        out: dict[Any, Any] = {}
        for knode, vnode in self._flatten(node, path, 0):
            usable, key = self._key(knode)
            if not usable:
                check_depth(knode, len(path) + 2)
                self.doc.problems.append((path, mark(knode), "keys must be plain scalars"))
                continue
            self._count(repeat_at)  # a key is a value written (or repeated) too
            where = (*path, key)
            self.doc.keypos[where] = mark(knode)
            if not isinstance(key, str):
                self.doc.written[(*where, "[key]")] = shown_text(knode.value)
            if _loc_name(key) != key:
                self.doc.loc_keys[(*path, _loc_name(key))] = key
            out[key] = self.walk(vnode, where, repeat_at)
        return out

    def _flatten(self, node: MappingNode, path: Path, depth: int) -> list[tuple[Node, Node]]:
        """`node.value` with `<<` merges applied.

        What PyYAML's `flatten_mapping` does, minus its cost: merged keys are
        deduplicated (the first merge source that has a key wins, a key
        written here wins over all), every pair copied counts as a repeat
        (used at `path`), merge chains count as nesting, and each mapping is
        flattened once. Done here rather than by PyYAML so the result is the
        same on every PyYAML 6.x.
        """
        if not any(k.tag in (_MERGE, _VALUE) for k, _ in node.value):
            return cast("list[tuple[Node, Node]]", list(node.value))
        done = self.flat.get(id(node))
        if done is not None:
            return done
        if depth >= MAX_DEPTH:
            raise TooDeep(node.start_mark)
        merged: dict[Any, tuple[Node, Node]] = {}
        own: list[tuple[Node, Node]] = []
        for knode, vnode in node.value:
            if knode.tag == _VALUE:
                knode.tag = STR_TAG
            if knode.tag != _MERGE:
                own.append((knode, vnode))
                continue
            sources = vnode.value if isinstance(vnode, SequenceNode) else [vnode]
            for source in sources:
                if not isinstance(source, MappingNode):
                    expected = "a mapping" if isinstance(vnode, SequenceNode) else _MERGE_EXPECTED
                    raise ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"expected {expected} for merging, but found {source.id}",
                        source.start_mark,
                    )
                for k, v in self._flatten(source, path, depth + 1):
                    self._count(path)
                    usable, key = self._key(k)
                    if usable and key not in merged:
                        merged[key] = (k, v)
        out = [*merged.values(), *own]
        self.flat[id(node)] = out
        return out


_MERGE_EXPECTED = "a mapping or list of mappings"


def _hashable(key: object) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


FAST_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", PureLoader)
"""libyaml when PyYAML has it: 3-4x faster on big user lists. Its error
messages differ (and say less), so a file that fails is re-read by the pure
Python parser: the messages are then the same on every install."""


def _yaml_problem(e: yaml.MarkedYAMLError, source: str) -> Problem:
    where = e.problem_mark or e.context_mark
    line, col = (where.line + 1, where.column + 1) if where else (1, 1)
    problem = e.problem or e.context or "cannot parse"
    if e.problem and e.context and e.context_mark is not None:
        problem += f" ({e.context} at line {e.context_mark.line + 1})"
    return Problem(source, line, col, "<root>", f"invalid YAML: {problem}")


def compose(
    text: str, source: str, loader_cls: type[yaml.SafeLoader] | None = None, empty_ok: bool = False
) -> tuple[Any, Doc]:
    """Parse YAML into (data, positions); syntax errors and crossed limits
    become a PolicyError. An empty document is one too, unless `empty_ok`
    (then the data is None)."""
    doc = Doc()
    loader_cls = loader_cls or FAST_LOADER
    pure = loader_cls is PureLoader
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
        if node is None:
            if empty_ok:
                return None, doc
            expected = "empty policy; expected a mapping with 'version: 1' and 'default'"
            raise PolicyError([Problem(source, 1, 1, "<root>", expected)])
        data = _Walker(loader, doc).walk(node, ())
    except yaml.MarkedYAMLError as e:
        if not pure and len(text) <= PURE_REREAD_MAX_BYTES:
            return compose(text, source, PureLoader, empty_ok)
        raise PolicyError([_yaml_problem(e, source)]) from e
    except yaml.YAMLError as e:  # pragma: no cover - every PyYAML error we know is marked
        raise PolicyError([Problem(source, 1, 1, "<root>", f"invalid YAML: {e}")]) from e
    except TooDeep as e:
        if not pure and len(text) <= PURE_REREAD_MAX_BYTES:
            return compose(text, source, PureLoader, empty_ok)  # the pure composer finds it first
        message = f"nested deeper than {MAX_DEPTH} levels (the limit)"
        line, col = e.where.line + 1, e.where.column + 1
        raise PolicyError([Problem(source, line, col, "<root>", message)]) from None
    except TooBig as e:
        line, col = doc.keypos.get(e.path) or doc.pos.get(e.path[:-1], (1, 1))
        message = (
            f"aliases expand to more than {MAX_ALIAS_VALUES} values beyond the file's own"
            " (alias bomb?)"
        )
        raise PolicyError([Problem(source, line, col, "<root>", message)]) from None
    finally:
        loader.dispose()
    return data, doc


def check_parse_limits(text: str, source: str) -> None:
    """YAML syntax and the parse limits alone (nesting, alias expansion), for a
    YAML file outrate is handed that is not a policy (a vLLM `--config`
    file): a PolicyError located where one is crossed. Within them PyYAML's
    own parse of the file is bounded (without them 5,000 levels of `[` were a
    RecursionError, and an alias bomb took gigabytes); what the values mean,
    and which scalar spellings are refused, stay the caller's."""
    compose(text, source, empty_ok=True)
