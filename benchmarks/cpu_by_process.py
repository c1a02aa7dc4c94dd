"""Where a command's CPU time goes, by the process trees it starts
(docs/development.md, "Test time"): which servers, subprocesses and pytest
runs `make test` pays for.

    python benchmarks/cpu_by_process.py -- make test

It runs the command and samples /proc every 0.5 s: each process's CPU
time (user + system, all its threads) as last seen, its command line and
its parent. A process that lives less than a sample is missed, and so is
what a process spends after its last sample (at most 0.5 s of it). At the
end every process the command started (itself and what descends from
it; not another job's processes on the machine, nor one whose parent ended
unseen) is charged to its tree's root, the
process just below the command, `tests/lanes.py` or a pytest run (or the
pytest run itself), and the roots
are summed by kind: `outrate serve` and stock servers (start-up, and the
load the tests put on them), pytest runs (the test bodies, the players),
other subprocesses. Prints the kinds, then the roots of 3 CPU s or more.
The sampler costs ~1% of a core.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from serverproc import all_pids, cpu_of, stat_fields  # noqa: E402

SAMPLE_S = 0.5


@dataclass
class Proc:
    pid: int
    ppid: int
    cmd: str
    first: float
    last: float
    cpu: float


def sample(seen: dict[tuple[int, int], Proc], now: float) -> None:
    """One pass over /proc: new processes added, known ones updated."""
    for pid in all_pids():
        fields = stat_fields(pid)
        if not fields:
            continue  # it ended meanwhile
        key = (pid, int(fields[19]))  # pid, start time: pids are reused
        p = seen.get(key)
        if p is None:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            text = cmd.replace(b"\0", b" ").decode(errors="replace").strip()
            seen[key] = Proc(pid, int(fields[1]), text, now, now, cpu_of(fields))
        else:
            p.cpu, p.last = cpu_of(fields), now


def kind(cmd: str) -> str:
    if "-m pytest" in cmd:
        return "pytest runs"
    if "outrate serve" in cmd:
        return "outrate serve"
    if "vllm.entrypoints" in cmd or "vllm serve" in cmd:
        return "stock vLLM servers"
    for word in ("mypy", "ruff", "lint-imports", "redis-server", "prometheus", "demo.py"):
        if word in cmd:
            return word
    return "other subprocesses"


def report(seen: dict[tuple[int, int], Proc], started: set[int], top: int) -> None:
    new = [p for p in seen.values() if p.pid not in started]
    by_pid: dict[int, list[Proc]] = collections.defaultdict(list)
    for p in new:
        by_pid[p.pid].append(p)

    def parent(p: Proc) -> Proc | None:
        alive = [q for q in by_pid.get(p.ppid, []) if q.first <= p.first + SAMPLE_S]
        return alive[-1] if alive else None

    def below_top(p: Proc) -> bool:
        q: Proc | None = p
        while q is not None:
            if q.pid == top:
                return True
            q = parent(q)
        return False

    roots: dict[int, list] = {}
    for p in new:
        if not below_top(p):
            continue  # not the command's: another job's process on the machine
        root, up = p, parent(p)
        while up is not None and up.pid != top and "-m pytest" not in root.cmd:
            if "lanes.py" in up.cmd:
                break
            root, up = up, parent(up)
        entry = roots.setdefault(id(root), [root, 0.0])
        entry[1] += p.cpu
    kinds: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for root, cpu in roots.values():
        kinds[kind(root.cmd)] += cpu
        count[kind(root.cmd)] += 1
    print(f"CPU seconds of the processes started: {sum(kinds.values()):.0f}")
    for k, cpu in kinds.most_common():
        print(f"{cpu:8.1f} s  {count[k]:4d} trees  {k}")
    print()
    for root, cpu in sorted(roots.values(), key=lambda r: -r[1]):
        if cpu >= 3:
            print(f"{cpu:8.1f} s  {root.first:5.0f}-{root.last:5.0f} s  {root.cmd[:110]}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__)
        return 2
    seen: dict[tuple[int, int], Proc] = {}
    sample(seen, 0.0)
    started = {p.pid for p in seen.values()}
    t0 = time.monotonic()
    child = subprocess.Popen(argv)
    while child.poll() is None:
        sample(seen, time.monotonic() - t0)
        time.sleep(SAMPLE_S)
    report(seen, started, child.pid)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
