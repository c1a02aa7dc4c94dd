"""The policy path points one way: file -> loader -> Policy -> compiler ->
CompiledPolicy -> Limiter. Every `outrate` module has a layer; a module may
import (at run time, inside functions or under TYPE_CHECKING alike) only
modules of lower layers. A new module must be given a layer here."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "outrate"

LAYERS: dict[str, int] = {
    "units": 0,  # formatting only: imports nothing
    "histogram": 0,  # imports nothing
    "filekind": 0,  # the words for a path that is not a regular file
    # leaves
    "errors": 1,
    "identity": 1,
    "limiter": 1,  # the bottom of the path: imports only units
    "trace": 2,  # imports errors
    "vllm_flags_0_32": 1,  # generated flag lists: text only
    "vllm_flags_0_33": 1,
    "policy_file": 2,
    "gate": 2,  # the API server's per-request identity decision
    "store": 2,
    "lease_scripts": 1,  # the Lua scripts: text only
    "lease": 2,  # the key layout and the Redis link
    "shared": 2,  # SharedLimiter: a second BudgetStore
    "store_metrics": 2,
    "lease_runner": 3,
    "values": 2,  # the format's scalars: rates, durations, ids
    "policy": 3,
    "compose": 3,
    "deployment": 3,
    "loader": 4,
    "keys": 4,  # the keys file of identity.source api_key
    "compiler": 4,  # never the loader: the two meet in pipeline
    "pipeline": 5,
    "metrics": 5,
    "rules": 4,  # deployment and exposure rules, a table each
    "lint": 6,
    "changes": 5,
    "reload": 6,
    "fetch": 2,  # top's scrape: one HTTP page within a deadline and a size cap
    "top": 6,
    "cli": 7,
    "__main__": 8,
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
    assert imports_of(CORE / "limiter.py") == {"units"}  # nothing of the pipeline
    assert not imports_of(CORE / "compiler.py") & {"loader", "compose", "policy_file", "pipeline"}
