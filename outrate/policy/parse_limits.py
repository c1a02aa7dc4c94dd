"""The hard limits on parsing a policy file: nesting depth and alias expansion.

A policy file comes from people and tools we do not control and is parsed by
the engine that serves every user. These limits are what keeps that parse
bounded; they are separate from the composer (`outrate.policy.compose`) so
the numbers, and the parser that enforces the nesting limit before PyYAML's
own recursion can overflow, read in one place:

- nesting depth (`MAX_DEPTH`): PyYAML's composer and our walk recurse, a few
  Python frames per level; without a limit ~500 levels of `[` overflow the
  stack (libyaml refuses at 1000, then the pure-Python parser overflowed).
- alias expansion (`MAX_ALIAS_VALUES`): aliases and `<<` merges may add at
  most this many values (keys count) beyond the number the file writes out
  itself, so work and memory stay proportional to the file's size ("billion
  laughs" bombs are refused after a few milliseconds).
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

MAX_DEPTH = 32
"""Nesting levels of mappings and lists (a policy needs 3)."""
MAX_ALIAS_VALUES = 10_000
"""Values aliases and merges may add beyond the ones the file writes out."""
PURE_REREAD_MAX_BYTES = 1 << 20
"""A file libyaml refuses is re-read by the pure-Python parser, so messages are
the same on every install; above this size (seconds of pure-Python parsing in
the engine) libyaml's own message is reported."""


class TooBig(Exception):
    """Aliases and merges expanded to more than `MAX_ALIAS_VALUES` repeats."""

    def __init__(self, path: tuple[Any, ...]) -> None:
        self.path = path
        """Where the alias (or merge) that crossed the limit was used."""


class TooDeep(Exception):
    """Collections nested deeper than `MAX_DEPTH`, first crossed at `where`."""

    def __init__(self, where: yaml.Mark) -> None:
        self.where = where


def check_depth(node: Node, depth: int) -> None:
    """The nesting limit inside a complex key, which the walk does not enter
    (the pure-Python composer counts it, and results must not depend on libyaml)."""
    todo = [(node, depth)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, ScalarNode):
            continue
        if level > MAX_DEPTH:
            raise TooDeep(item.start_mark)
        if isinstance(item, MappingNode):
            children = [n for pair in item.value for n in pair]
        else:
            children = list(item.value)
        todo += [(child, level + 1) for child in reversed(children)]


class PureLoader(yaml.SafeLoader):
    """PyYAML's pure-Python loader with the nesting limit: its composer recurses
    (two frames a level, overflowing near 500 levels) and its scanner reads a
    run of `[` or `{` to the end before emitting a token, with quadratic cost
    in the flow level (5000 levels took seconds). Flow nesting is refused by
    the scanner, which sees it first; block nesting by the composer."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # noqa: N803 - PyYAML's name
        if self.flow_level >= MAX_DEPTH:
            raise TooDeep(self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if not self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent):
            return super().compose_node(parent, index)
        if self._depth >= MAX_DEPTH:
            raise TooDeep(self.peek_event().start_mark)  # type: ignore[no-untyped-call]
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
