"""Test-wide setup: the example scripts (model builder, server harness, load
generator) are importable by tests, which is also how they are kept working."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for extra in (REPO / "examples", REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
