"""Bombs on a live engine's policy file: YAML alias bombs ("billion laughs",
and the same through `<<` merges) and nesting bombs (5,000 levels of flow
lists, 200 of block mappings) written over the policy of the session's
`outrate serve` (conftest.py). Each edit is refused within seconds with the
very lines `outrate lint` prints, the engine keeps serving at its last good
policy, and a later good edit applies (here one that turns a user to shadow,
which the reload line now says). The original policy is restored."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

from e2e_support import POLICY, use_policy  # noqa: E402
from loadgen import client  # noqa: E402

from outrate.errors import PolicyError  # noqa: E402
from outrate.policy.loader import parse_policy_bytes  # noqa: E402

pytestmark = pytest.mark.e2e

BAD = REPO / "tests" / "fixtures" / "bad"
BOMBS: dict[str, Callable[[], bytes]] = {
    "alias bomb": lambda: (BAD / "alias_bomb.yaml").read_bytes(),
    "merge bomb": lambda: (BAD / "merge_bomb.yaml").read_bytes(),
    "flow nesting bomb": lambda: (
        "version: 1\ndefault: 1\nusers: {alice: " + "[" * 5000 + "]" * 5000 + "}\n"
    ).encode(),
    "block nesting bomb": lambda: (
        "version: 1\ndefault: 1\nusers:\n"
        + "".join(f"{'  ' * (i + 1)}k{i}:\n" for i in range(200))
        + "  " * 201
        + "x: 1\n"
    ).encode(),
}
REFUSED_WITHIN_S = 10
"""The reloader's debounce is 150 ms and a refused bomb costs milliseconds;
seconds leave room for a loaded two-core machine."""


class ServerLog:
    """The session server's log from a mark on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size

    def text(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode("utf-8", "replace")

    def wait_for(self, found: Callable[[str], bool], what: str, timeout_s: float) -> float:
        """Seconds until `found(text since the mark)`."""
        started = time.monotonic()
        while not found(self.text()):
            if time.monotonic() - started > timeout_s:
                tail = self.text()[-3000:]
                raise AssertionError(f"not logged within {timeout_s} s: {what}\n{tail}")
            time.sleep(0.02)
        return time.monotonic() - started


def replace_policy(path: Path, data: bytes) -> None:
    """Swap the policy in one step (never half a file)."""
    tmp = path.with_name(f".next-{time.monotonic_ns()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def lint_lines(data: bytes, source: str) -> list[str]:
    """What `outrate lint` says about `data` at `source`: the lines the
    reload must log."""
    with pytest.raises(PolicyError) as info:
        parse_policy_bytes(data, source)
    return str(info.value).splitlines()


def served(server) -> int:  # type: ignore[no-untyped-def]
    answer = client(server.base_url).completions.create(
        model="tiny", prompt="still there?", max_tokens=4,
        extra_body={"ignore_eos": True, "vllm_xargs": {"output_rate_user": "acc-20-1"}},
    )  # fmt: skip
    return int(answer.usage.completion_tokens)


def test_bombs_on_a_live_reload_are_refused_and_the_engine_serves_on(server) -> None:  # type: ignore[no-untyped-def]
    path: Path = server.policy_path
    header = f"{path}: reload rejected, keeping the last good policy:"
    took: dict[str, float] = {}
    try:
        for name, make in BOMBS.items():
            data = make()
            expected = [header, *lint_lines(data, str(path))]
            log = ServerLog(Path(server.log_path))
            replace_policy(path, data)

            def logged(text: str, lines: list[str] = expected) -> bool:
                return all(line in text for line in lines)

            took[name] = log.wait_for(logged, "\n".join(expected), REFUSED_WITHIN_S)
            assert "Traceback" not in log.text()
            assert served(server) == 4
        # A good edit applies after them, and says what it changed: shadow too.
        for edit, said in (
            ("  bomb-check: 7\n", "bomb-check added (7 tok/s)"),
            ("  bomb-check: {rate: 7, shadow: true}\n", "bomb-check 7 tok/s -> 7 tok/s shadow"),
        ):
            log = ServerLog(Path(server.log_path))
            replace_policy(path, (POLICY + edit).encode())
            log.wait_for(lambda text, s=said: f"policy reloaded: {s}" in text, said, 30)
    finally:
        use_policy(server, POLICY)  # the next tests share this server and its policy
    print("refused after: " + ", ".join(f"{k} {v:.2f} s" for k, v in took.items()))
    assert served(server) == 4
