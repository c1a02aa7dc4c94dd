"""How fast is `outrate simulate`? The issue's target: 60 simulated seconds of
64 streams over 8 users in under 10 s of wall time (on the 2-core machine).

    python benchmarks/bench_simulate.py [--seconds 60] [--async] [--check]
    python benchmarks/bench_simulate.py --steps WORKLOAD POLICY [ENGINE FLAGS...]

The workload: 8 users with 8 closed-loop streams each (prompts 100-800
tokens, outputs 50-400, think 0-1 s); half of the users limited to 150 tok/s
(their streams are held and their admissions deferred), one capped at 4
streams; `--max-num-seqs 64 --max-num-active-seqs 48`, the default step
model. Prints the wall time of the simulation itself and, apart, of what
comes before it (importing vLLM, building the scheduler: a fixed cost of
the command, several seconds here), with the steps and tokens simulated.

A report, not a test: exits 0 unless --check is given and the target is
missed. tests/test_simulate_cli.py smoke-runs it with --seconds 2.

`--steps` simulates a workload file under a policy file instead (engine
flags after them) and prints the scheduler's own time a step, `schedule()`
alone, median and mean: what docs/performance.md ("Deferred waiting
requests") reads on examples/workloads/oos-hog.yaml.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 10.0
POLICY = """\
version: 1
default: unlimited
users:
  user-1: 150
  user-2: 150
  user-3: 150
  user-4: {rate: 150, max_streams: 4}
"""


def workload_text(seconds: float) -> str:
    return f"""\
version: 1
duration: {seconds:g}s
seed: 1
users:
  user:
    count: 8
    streams: 8
    ramp: 1s
    think: {{uniform: [0s, 1s]}}
    prompt: {{uniform: [100, 800]}}
    output: {{uniform: [50, 400]}}
"""


def schedule_us(workload: str, policy: str, flags: list[str]) -> int:
    """`--steps`: `schedule()`'s wall time a step over one simulation."""
    import statistics

    from outrate.simulate.engine import engine_from_flags
    from outrate.simulate.stepmodel import StepModel
    from outrate.simulate.workload import load_workload
    from vllm_integration.offline.simulator import Simulation

    sim = Simulation(
        load_workload(workload).workload, engine_from_flags(flags), policy, StepModel()
    )
    sched, times = sim.sched, []
    schedule = sched.schedule

    def timed(*args: object) -> object:
        t = time.perf_counter_ns()
        out = schedule(*args)
        times.append(time.perf_counter_ns() - t)
        return out

    sched.schedule = timed
    sim.run()
    print(
        f"{workload}: {len(times)} steps, schedule() median "
        f"{statistics.median(times) / 1e3:.0f} us, mean {statistics.fmean(times) / 1e3:.0f} us"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--steps"]:
        return schedule_us(argv[1], argv[2], argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated seconds")
    ap.add_argument("--async", dest="async_", action="store_true", help="AsyncScheduler")
    ap.add_argument("--check", action="store_true", help="exit 1 if the target is missed")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    from outrate.simulate.engine import engine_from_flags
    from outrate.simulate.stepmodel import StepModel
    from outrate.simulate.workload import parse_workload
    from vllm_integration.offline.simulator import Simulation

    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(POLICY)
        flags = ["--max-num-seqs", "64", "--max-num-active-seqs", "48"]
        if args.async_:
            flags.append("--async-scheduling")
        workload = parse_workload(workload_text(args.seconds), "bench")
        sim = Simulation(workload, engine_from_flags(flags), str(policy), StepModel())
        ready = time.perf_counter()
        result = sim.run()
    setup_s = ready - started
    e = result.engine
    streams = len(sim.plan.streams)
    print(
        f"bench_simulate: {args.seconds:g} simulated s, {streams} streams over "
        f"{len(result.users)} users, {'async' if args.async_ else 'sync'}"
    )
    per_step_us = result.wall_s / e.steps * 1e6
    print(
        f"  simulation   {result.wall_s:6.2f} s wall  ({e.steps} steps, {e.tokens} tokens, "
        f"{e.steps / result.wall_s:.0f} steps/s, {per_step_us:.0f} us/step)"
    )
    print(f"  before it    {setup_s:6.2f} s wall  (import vLLM, build the scheduler)")
    held = sum(u.held_share for u in result.users.values()) / len(result.users)
    print(f"  mean held share {held:.0%}, KV preemptions {e.kv_preemptions}")
    scale = 60.0 / args.seconds
    verdict = "PASS" if result.wall_s * scale < TARGET_S else "MISS"
    print(
        f"  target: 60 simulated s in < {TARGET_S:g} s wall: "
        f"{result.wall_s * scale:.2f} s {verdict}"
    )
    return 1 if args.check and verdict != "PASS" else 0


if __name__ == "__main__":
    sys.exit(main())
