"""How fast is the limiter, and how much does an idle user cost?

    python benchmarks/bench_limiter.py [--quick] [--users N] [--iterations N] [--check]

Prints a table: ns per `try_take` (keyed API: dict lookup + decision), per
`take` (bucket API, on the bucket a request holds) and per `take_upto(b, now,
4)` (the scheduler's hot path: a user's tokens for a step, here a user with
four running requests; granted: the share of tokens asked) for 1, 1_000 and
N users (1M; 100k with --quick), bytes per idle user, and the time of
one `cleanup(now, 64)` with N idle users. Each timing is the median of several
repeats over enough calls. Users (100 tok/s each, burst 100ms) are visited
round-robin while a fake clock (`now`, passed to every call) advances, each
user every ~5ms: with few users about half the takes are refused, with many
users each is visited only a few times and stays within its burst. The
granted share is printed.
The per-call times include the Python `for` loop that drives them (its own cost
is printed on a separate line), so they are an upper bound.

This is a report, not a test: it exits 0 unless --check is given and a target
is missed. tests/test_limiter.py runs it with tiny sizes so it never rots.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence

from outrate.budget.limiter import Limiter
from outrate.policy.pipeline import policy_from_flags

RATE = 100  # tokens/s for every user; burst: the policy default (100ms)
START_NS = 10**12
VISIT_NS = 5_000_000
"""Each user is visited every ~5ms, twice its 10ms pace."""

TARGET_CALL_NS = 1_000
TARGET_IDLE_BYTES = 250
TARGET_CLEANUP_US = 100


def _user_keys(n: int) -> list[str]:
    return [f"user-{i:07d}" for i in range(n)]


def _limiter() -> Limiter:
    return Limiter(policy_from_flags(RATE, None), clock=_no_clock)


def _no_clock() -> int:
    raise AssertionError("every call passes `now`: the fake clock")


def _step(users: int) -> int:
    """Clock advance per call, so that each user comes back every ~VISIT_NS."""
    return max(1, VISIT_NS // users)


def _timed(
    loop: Callable[[int], int], calls: int, step: int, repeats: int, clock: list[int]
) -> tuple[float, float]:
    """Median ns per call over `repeats` runs of `loop`, and the granted share.
    `clock` is the fake clock, shared by all loops over one table so it never
    runs backwards."""
    per_call, granted = [], 0
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter_ns()
        granted += loop(clock[0])
        per_call.append((time.perf_counter_ns() - start) / calls)
        clock[0] += calls * step
    return statistics.median(per_call), granted / (calls * repeats)


def bench_calls(users: int, iterations: int, repeats: int) -> dict[str, tuple[float, float]]:
    """ns per try_take and per take with `users` users visited round-robin."""
    keys = _user_keys(users)
    limiter = _limiter()
    buckets = [limiter.bucket(k) for k in keys]  # a warm table: creation is not timed
    calls = max(iterations, users)
    seq_keys = (keys * -(-calls // users))[:calls]
    seq_buckets = (buckets * -(-calls // users))[:calls]
    step = _step(users)

    def try_take(now: int) -> int:
        tt, got = limiter.try_take, 0
        for k in seq_keys:
            got += tt(k, now)
            now += step
        return got

    def take(now: int) -> int:
        t, got = limiter.take, 0
        for b in seq_buckets:
            got += t(b, now)
            now += step
        return got

    def take_upto(now: int) -> int:
        t, got = limiter.take_upto, 0
        for b in seq_buckets:
            got += t(b, now, 4)
            now += step
        return got

    def loop_alone(now: int) -> int:
        got = 0
        for _ in seq_buckets:
            got += False
            now += step
        return got

    clock = [START_NS]
    return {
        name: _timed(loop, calls, step, repeats, clock)
        for name, loop in (
            ("try_take", try_take),
            ("take", take),
            ("take_upto", take_upto),
            ("loop", loop_alone),
        )
    }


def bench_memory(users: int) -> tuple[float, float, Limiter]:
    """Traced bytes per idle user, with and without its key string.

    Each user took one token, so its TAT is a real int object (as it is for
    any user that was ever served), then went idle. The key list itself (8
    bytes a user) belongs to the caller and is counted in neither figure.
    """
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        keys = _user_keys(users)
        after_keys = tracemalloc.get_traced_memory()[0] - sys.getsizeof(keys)
        limiter = _limiter()
        bucket, take = limiter.bucket, limiter.take
        for k in keys:
            take(bucket(k), START_NS)
        after = tracemalloc.get_traced_memory()[0] - sys.getsizeof(keys)
    finally:
        tracemalloc.stop()
    with_keys = (after - base) / users
    without_keys = (after - after_keys) / users
    return without_keys, with_keys, limiter


def bench_cleanup(limiter: Limiter, samples: int = 101) -> tuple[float, float, int]:
    """Median and max ns of one cleanup(now, 64) call over a table of idle users."""
    now = START_NS + 10 * 1_000_000_000  # long after everyone's last token
    size = len(limiter)
    times = []
    for _ in range(samples):
        start = time.perf_counter_ns()
        limiter.cleanup(now, 64)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times), max(times), size


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k users, fewer calls")
    parser.add_argument("--users", type=int, help="largest user count (default 1M; 100k quick)")
    parser.add_argument("--iterations", type=int, help="calls per repeat (default 1M; 200k quick)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    most = args.users or (100_000 if args.quick else 1_000_000)
    iterations = args.iterations or (200_000 if args.quick else 1_000_000)
    repeats = 3 if args.quick else 7
    counts = sorted({1, min(1_000, most), most})

    rows: list[tuple[str, str, str, str]] = []
    ok = True

    def row(what: str, value: float, unit: str, target: float | None) -> None:
        nonlocal ok
        if target is None:
            rows.append((what, f"{value:,.1f} {unit}", "", ""))
            return
        verdict = "PASS" if value <= target else "FAIL"
        ok = ok and verdict == "PASS"
        rows.append((what, f"{value:,.1f} {unit}", f"<= {target:,} {unit}", verdict))

    print(
        f"outrate limiter benchmark: {RATE} tok/s per user, {iterations:,} calls x "
        f"{repeats} repeats (median), Python {sys.version.split()[0]}"
    )
    for users in counts:
        who = f"{users:,} user" + ("s" if users != 1 else "")
        result = bench_calls(users, iterations, repeats)
        (tt, tt_share), (tk, tk_share), (tu, tu_share), (loop, _) = (
            result["try_take"],
            result["take"],
            result["take_upto"],
            result["loop"],
        )
        row(f"try_take, {who} ({tt_share:.0%} granted)", tt, "ns", TARGET_CALL_NS)
        row(f"take (bucket), {who} ({tk_share:.0%} granted)", tk, "ns", TARGET_CALL_NS)
        row(f"take_upto(4), {who} ({tu_share / 4:.0%} granted)", tu, "ns", TARGET_CALL_NS)
        row(f"  for-loop alone, {who} (included above)", loop, "ns", None)

    without_keys, with_keys, limiter = bench_memory(most)
    row(f"bytes per idle user, {most:,} users, limiter only", without_keys, "B", TARGET_IDLE_BYTES)
    row(
        f"bytes per idle user, {most:,} users, with its 12-char key",
        with_keys,
        "B",
        TARGET_IDLE_BYTES,
    )
    median, worst, size = bench_cleanup(limiter)
    row(f"cleanup(now, 64), {size:,} idle users, median", median / 1000, "us", TARGET_CLEANUP_US)
    row(f"cleanup(now, 64), {size:,} idle users, max", worst / 1000, "us", None)

    widths = [max(len(r[i]) for r in [("what", "measured", "target", ""), *rows]) for i in range(4)]
    for r in [("what", "measured", "target", ""), *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip())
    if not ok:
        print("some targets missed" + (" (--check: exit 1)" if args.check else ""))
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
