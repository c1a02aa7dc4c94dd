"""Which YAML scalar spellings become which values, and which are refused.

Separate from the composer (`outrate.policy.compose`), which walks the node
tree, because this is a question about one scalar at a time, with rules of
its own. YAML 1.1 spells some numbers in ways nobody means in a policy
(`1:30` is 90 in base 60, `0x10` is 16, `010` is 8, `1e-400` is 0 to most
parsers): those are errors with a hint to quote, as are scalars PyYAML cannot
construct (`2024-99-99`, a 5000-digit integer). Numbers with a fraction or
an exponent are read exactly, as `Decimal` (0.1 is one tenth).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

import yaml
from yaml.nodes import ScalarNode

from outrate.policy.values import shown

STR_TAG = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
# YAML 1.1 (PyYAML) reads `1e6` as a string; YAML 1.2 and humans read a number.
_EXP_NUMBER = re.compile(r"[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)[eE][-+]?\d+")
_DECIMAL = re.compile(r"[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][-+]?\d+)?")
# Integer spellings only YAML 1.1 has; YAML 1.2, JSON and people read them otherwise.
_YAML11_INT = (
    (re.compile(r"[-+]?0b[01_]+"), "binary"),
    (re.compile(r"[-+]?0x[0-9a-fA-F_]+"), "hexadecimal"),
    (re.compile(r"[-+]?0[0-7_]+"), "octal"),
    (re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?"), "base 60"),
)
_SMALLEST_FLOAT_EXP = -324
"""Decimal exponents below this underflow an IEEE double to 0."""
_CONSTRUCTED_AS = {
    _INT: "an integer",
    _FLOAT: "a number",
    "tag:yaml.org,2002:bool": "a boolean",
    "tag:yaml.org,2002:null": "null",
    "tag:yaml.org,2002:timestamp": "a date",
    "tag:yaml.org,2002:binary": "binary data",
}


class BadScalar(Exception):
    """A scalar we refuse to turn into a value; the message says why."""


def read_scalar(loader: yaml.SafeLoader, node: ScalarNode, key: bool = False) -> Any:
    """The value of `node`, as a value (`key=False`) or as a mapping key.

    A key `1e5` stays a name and a key `1.5` keeps its digits; the
    ambiguous-number refusals apply to values only.
    """
    text = node.value
    plain = not node.style
    if node.tag == _FLOAT and _DECIMAL.fullmatch(text):
        return _decimal(text, plain and not key)  # exact: 0.1 is one tenth
    if not key and node.tag == STR_TAG and plain and _EXP_NUMBER.fullmatch(text):
        return _decimal(text, True)  # a value; a key `1e5` stays a name
    if plain and not key and node.tag in (_INT, _FLOAT):
        for pattern, kind in _YAML11_INT:
            if pattern.fullmatch(text):
                raise BadScalar(_ambiguous(text, kind, _construct(loader, node)))
    return _construct(loader, node)


def _construct(loader: yaml.SafeLoader, node: ScalarNode) -> Any:
    try:
        return loader.construct_object(node, deep=True)
    except yaml.YAMLError:
        raise  # an unknown tag: invalid YAML, reported as such
    except Exception as e:
        # `!!int abc` (ValueError), `!!bool abc` (KeyError), `!!timestamp x`
        # (AttributeError), `2024-99-99`, an integer of more than 4300 digits
        what = _CONSTRUCTED_AS.get(node.tag, repr(node.tag))
        raise BadScalar(
            f"cannot read {shown(node.value)} as {what}; quote it if you meant text"
        ) from e


def _decimal(text: str, value: bool) -> Decimal:
    number = Decimal(text.replace("_", ""))
    if value and number and number.adjusted() < _SMALLEST_FLOAT_EXP:
        raise BadScalar(
            f"ambiguous number {shown_text(text)}: most YAML parsers read it as 0 "
            "(it is too small for a float); quote it if you meant text"
        )
    return number


def _ambiguous(text: str, kind: str, value: Any) -> str:
    as_read = f" ({value})" if len(text) <= 20 else ""
    return (
        f"ambiguous number {shown_text(text)}: YAML 1.1 reads it as {kind}{as_read}; "
        "write it in decimal, or quote it if you meant text"
    )


def shown_text(text: str) -> str:
    """How a scalar was written, cut at 40 characters, for messages and hints."""
    return text if len(text) <= 40 else text[:37] + "..."
