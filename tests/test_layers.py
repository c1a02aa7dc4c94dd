"""The policy path points one way: file -> loader -> Policy -> compiler ->
CompiledPolicy -> Limiter. Every `outrate` module has a layer; a module may
import (at run time, inside functions or under TYPE_CHECKING alike) only
modules of lower layers. A new module must be given a layer here."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "outrate"

LAYERS: dict[str, int] = {
    # leaves
    "errors": 0,
    "identity": 0,
    "limiter": 0,  # the bottom of the path: no outrate import at all
    "trace": 0,
    "vllm_flags": 0,
    "policy_file": 1,
    "gate": 1,  # the API server's per-request identity decision
    "store": 1,
    "policy": 1,
    "compose": 2,
    "deployment": 2,
    "loader": 3,
    "keys": 3,  # the keys file of identity.source api_key
    "compiler": 3,  # never the loader: the two meet in pipeline
    "pipeline": 4,
    "metrics": 4,
    "lint": 5,
    "reload": 5,
    "top": 5,
    "cli": 6,
    "__main__": 7,
    "__init__": 0,
}


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("outrate"):
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:  # `from outrate import x`
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("outrate."):
                    found.add(a.name.split(".")[1])
    return found


def test_every_module_has_a_layer():
    assert {p.stem for p in CORE.glob("*.py")} == set(LAYERS)


def test_imports_point_down_the_layers():
    wrong = []
    for path in sorted(CORE.glob("*.py")):
        me = path.stem
        for other in sorted(imports_of(path)):
            if other != me and LAYERS[other] >= LAYERS[me]:
                wrong.append(f"{me} (layer {LAYERS[me]}) imports {other} (layer {LAYERS[other]})")
    assert wrong == []


def test_the_limiter_is_a_leaf_and_the_compiler_never_loads():
    assert imports_of(CORE / "limiter.py") == set()
    assert not imports_of(CORE / "compiler.py") & {"loader", "compose", "policy_file", "pipeline"}
