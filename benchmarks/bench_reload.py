"""Edit -> apply latency of the policy reloader (native inotify observer).

    python benchmarks/bench_reload.py [--edits N]

Writes the policy N times and measures, for each, the time from the end of
the write to `on_apply` (the moment the scheduler's next step would see the
new policy). Most of it is the debounce (150 ms by default). Wall-clock, so
a benchmark, not a test: a loaded machine moves it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from outrate.policy.reload import Reloader


def policy_text(rate: int) -> str:
    return f"version: 1\ndefault: 100\nusers:\n  alice: {rate}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--edits", type=int, default=10)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "policy.yaml"
        path.write_text(policy_text(99))
        applied: list[float] = []
        event = threading.Event()

        def on_apply(_policy: object) -> None:
            applied.append(time.monotonic())
            event.set()

        r = Reloader(path, on_apply)
        r.start()
        event.wait(5)
        latencies = []
        try:
            for i in range(args.edits):
                event.clear()
                t0 = time.monotonic()
                path.write_text(policy_text(100 + i))
                if not event.wait(5):
                    print(f"edit {i} was not applied within 5 s", file=sys.stderr)
                    return 1
                latencies.append(applied[-1] - t0)
        finally:
            r.stop()
        print(
            f"edit -> on_apply over {args.edits} edits ({r.observer_kind} observer, debounce "
            f"{r.debounce_s * 1000:.0f} ms): median {statistics.median(latencies) * 1000:.1f} ms, "
            f"max {max(latencies) * 1000:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
