"""What the engine-side metrics cost per scheduler step.

    python benchmarks/bench_metrics.py [--quick] [--check] [--copies N] [--only CELLS]
    python benchmarks/bench_metrics.py --isolated [--quick] [--only CELLS]

Same rig as bench_scheduler.py (real vLLM schedulers, real KV cache manager,
fake clock, fabricated outputs, every request in decode, interleaved paired
rounds). Two outrate schedulers per cell: as shipped (tokens counted on the
user in the charging hook, a run's token intervals at its ends and at
checkpoints: vllm_integration/ledger.py), and the same scheduler without
them (`hook_without_metrics` below: the shipped hook minus its counting
lines, and a fold that only gives back unspent tokens, with no checkpoint:
`fold_without_metrics`). The step's start still notes its time and period
bucket in both (`Ledger.begin`: two ring writes and a bisect per step).
`ratio` = with / without, median over rounds of the per-round ratio of
medians. Target: <= 1.02 in every cell.

Each variant is built `--copies` times (default 3), alternately and in a
rotated order (no variant is always built first), and every copy runs in
the interleaved rounds; a round's figure for a variant is the median of its
copies' medians. Two schedulers built alike differ by a percent or two on
this VM (where their objects landed in memory), more than the effect
measured here; copies average that out. `a/a` is the same ratio, computed
the same way, between a second set of `--copies` schedulers without metrics
and the first (all three sets run in the same interleaved rounds): the
noise floor of the cell, with the same statistical power as `ratio`.

`--isolated` times the metric lines without the rest of the step around
them (`isolated`): the shipped charging hook over every running request
plus the fold, against the hook and fold without metrics, alternating on
one scheduler's own requests, as a share of that scheduler's full step.
It resolves what the end-to-end ratio cannot below its noise floor, and
misses what a whole step adds around them (cache effects of the extra
state); a throttled cell's resumes and holds are not in it. It also times
the checkpoint (`checkpoint_cost`), which the step medians leave out: it
comes once per 0.5 s of engine time, and its share is its time over that.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scheduler import (  # noqa: E402
    FULL,
    QUICK,
    Bench,
    build,
    copies_ratio,
    copies_us,
    interleave,
    model_dir,
    policy_for,
    workload,
)

from vllm_integration.ledger import FLUSH_NS  # noqa: E402

TARGET = 1.02


def hook_without_metrics(
    self: Any, request: Any, num_computed_tokens: int, num_new_tokens: int
) -> int:
    """OutrateMixin._reserve_prefill_lookahead without its metric lines."""
    if num_computed_tokens + num_new_tokens < len(request._all_token_ids) or not num_new_tokens:
        return num_new_tokens
    rs = request._outrate
    step = self._step
    if rs.charged_step == step:
        return num_new_tokens
    u = rs.user
    left = u.left
    if left:
        u.left = left - 1
    elif u.step != step:
        u.step = step
        want = u.resident - u.n_held
        b = u.bucket
        if want > 1 or b.gen != self._inline_gen:
            left = self.limiter.take_upto(b, self._now, want if want > 1 else 1)
            if left > 1:
                u.left = left - 1
                self._st.users.append(u)
        else:
            lim = b.limit
            scale = lim.scale
            left = 1
            if scale:
                now_s = self._now * scale
                tat = b.tat
                if tat < now_s:
                    tat = now_s
                elif tat - now_s > lim.tolerance:
                    left = 0
                if left:
                    b.tat = tat + lim.interval
    elif u.refused_step != step:
        left = self.limiter.take_upto(u.bucket, self._now, 1)
    if not left:  # no shadow count; the refused path is the shipped one (its one
        # metric line, `ledger.stopped`, runs in no timed step: nobody is refused there)
        return self.admission.refuse(
            request, rs, u, step, num_computed_tokens, self._st, self.ledger
        )
    rs.charged_step = step
    self._st.last_charge = request
    return num_new_tokens


def fold_without_metrics(
    self: Any, st: Any, step: int, now: int, requests: Any, users: Any
) -> None:
    """Ledger.fold without metrics (no checkpoint of live runs' intervals):
    what is left is giving back the step's unspent tokens (of the users
    granted more than one, in both variants)."""
    if st.users:
        self.give_back_unspent(st, now)


def isolated(b: Bench, reps: int) -> tuple[float, float, float]:
    """The metric lines alone, without the rest of a step around them: `b`'s
    scheduler (warmed into decode), alternately its shipped hook over
    every running request plus `Ledger.fold`, and `hook_without_metrics` plus
    `fold_without_metrics` (both give back unspent tokens), on the same
    objects. Returns the median ns per step of each and
    of their difference over adjacent pairs. What the end-to-end ratio
    cannot resolve below its noise floor, this measures directly."""
    sched = b.sched
    reqs = list(sched.running)
    computed = [len(q._all_token_ids) - 1 for q in reqs]
    shipped = sched._reserve_prefill_lookahead
    bare = types.MethodType(hook_without_metrics, sched)
    ledger, st = sched.ledger, sched._st
    live, users = sched.requests.values(), sched._users.values()
    fold = ledger.fold
    clock = time.perf_counter_ns

    def one(hook: Any, with_metrics: bool) -> int:
        sched._prev_step = sched._step
        sched._step += 1
        sched._now += 10_000_000
        step, now = sched._step, sched._now
        t0 = clock()
        if with_metrics:
            ledger.begin(step, now)
        for q, c in zip(reqs, computed, strict=True):
            hook(q, c, 1)
        if with_metrics:
            fold(st, step, now, live, users)
        else:
            fold_without_metrics(ledger, st, step, now, live, users)
        t = clock() - t0
        st.touched.clear()
        st.refused.clear()
        return t

    on, off, diff = [], [], []
    for i in range(reps):
        if i % 2:
            a = one(shipped, True)
            c = one(bare, False)
        else:
            c = one(bare, False)
            a = one(shipped, True)
        on.append(a)
        off.append(c)
        diff.append(a - c)
    return statistics.median(on), statistics.median(off), statistics.median(diff)


def checkpoint_cost(b: Bench, steps: int = 49, reps: int = 20) -> float:
    """What one checkpoint costs (`Ledger.checkpoint`: every live user's
    counts into its label, every live run's intervals into the histograms),
    after `steps` steps of the shipped hook: the runs it flushes are that
    long, as they are at a checkpoint every 50 steps of 10 ms. It comes
    once per `FLUSH_NS` of engine time, so the medians above leave it out.
    Returns the median ns over `reps` checkpoints."""
    sched = b.sched
    reqs = list(sched.running)
    computed = [len(q._all_token_ids) - 1 for q in reqs]
    hook, ledger, st = sched._reserve_prefill_lookahead, sched.ledger, sched._st
    live, users = sched.requests.values(), sched._users.values()
    clock = time.perf_counter_ns
    times = []
    for _ in range(reps):
        for _ in range(steps):
            sched._prev_step = sched._step
            sched._step += 1
            sched._now += 10_000_000
            ledger.begin(sched._step, sched._now)
            for q, c in zip(reqs, computed, strict=True):
                hook(q, c, 1)
            if st.users:
                ledger.give_back_unspent(st, sched._now)
        t0 = clock()
        ledger.checkpoint(live, users, sched._step, sched._now)
        times.append(clock() - t0)
    return statistics.median(times)


def main_isolated(args: Any) -> int:
    sizes = QUICK if args.quick else FULL
    with contextlib.redirect_stdout(sys.stderr):
        model_dir()
    print("The metric lines alone, per step (median ns), 16 users, none throttled:")
    print("the charging hook over every running request plus the fold, shipped")
    print("and without metrics, alternating on one scheduler; `share` = the")
    print("difference over a full step of the same scheduler (median us).")
    print("`ckpt us`: one checkpoint after 49 steps (`checkpoint_cost`); it runs")
    print("once per 0.5 s of engine time: `ckpt share` = its time over 0.5 s.")
    print(
        f"{'mode':>5}  {'R':>5}  {'step us':>8}  {'with ns':>8}  {'without':>8}  "
        f"{'diff ns':>8}  {'share':>6}  {'ckpt us':>8}  {'ckpt share':>10}"
    )
    for mode in ("sync", "async"):
        for r in (64, 256) if args.quick else (64, 256, 1024):
            if args.only and f"{mode}:{r}:0" not in args.only.split(","):
                continue
            w = workload(r, 16, 0.0)
            full = build(mode, w.users, sizes, policy_for(w))
            interleave([full], sizes)
            step_us = full.median_us()
            on, off, diff = isolated(full, 400)
            ckpt = checkpoint_cost(full)
            print(
                f"{mode:>5}  {r:>5}  {step_us:>8.0f}  {on:>8.0f}  {off:>8.0f}  "
                f"{diff:>8.0f}  {diff / 1000 / step_us:>6.2%}  {ckpt / 1000:>8.0f}  "
                f"{ckpt / FLUSH_NS:>10.3%}",
                flush=True,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="fewer cells and steps")
    ap.add_argument("--check", action="store_true", help="exit 1 if a cell misses the target")
    ap.add_argument("--copies", type=int, default=3, help="schedulers built per variant")
    ap.add_argument("--only", help="cells, e.g. sync:1024:0,async:256:0 (mode:R:throttled%%)")
    ap.add_argument(
        "--isolated",
        action="store_true",
        help="time the metric lines alone (hook over every request + fold) per step, "
        "against a full step of the same scheduler",
    )
    args = ap.parse_args(argv)
    if args.isolated:
        return main_isolated(args)
    sizes = QUICK if args.quick else FULL
    with contextlib.redirect_stdout(sys.stderr):
        model_dir()
    runnings = (64, 256) if args.quick else (64, 256, 1024)
    print("Per-step cost with metrics / without (median us), 16 users, all in decode.")
    print(
        f"{'mode':>5}  {'R':>5}  {'thr%':>4}  {'without':>8}  {'with':>8}  {'ratio':>6}  "
        f"{'a/a':>6}  result"
    )
    missed = 0
    for mode in ("sync", "async"):
        for r in runnings:
            for f in (0.0, 0.5):
                if args.only and f"{mode}:{r}:{f * 100:.0f}" not in args.only.split(","):
                    continue
                w = workload(r, 16, f)
                k = max(args.copies, 2)
                # Built alternately, each copy in a rotated order: no set
                # is always built first (where objects land is part of a cost).
                ons: list[Bench] = []
                offs: list[Bench] = []
                twins: list[Bench] = []
                for c in range(k):
                    for j in range(3):
                        group = (ons, offs, twins)[(c + j) % 3]
                        group.append(build(mode, w.users, sizes, policy_for(w)))
                for off in offs + twins:
                    off.sched._reserve_prefill_lookahead = types.MethodType(
                        hook_without_metrics, off.sched
                    )
                    off.sched.ledger.fold = types.MethodType(fold_without_metrics, off.sched.ledger)
                interleave([b for trio in zip(offs, ons, twins, strict=True) for b in trio], sizes)
                ratio = copies_ratio(ons, offs)
                noise = copies_ratio(twins, offs)
                ok = ratio <= TARGET
                missed += not ok
                print(
                    f"{mode:>5}  {r:>5}  {f * 100:>4.0f}  {copies_us(offs):>8.0f}  "
                    f"{copies_us(ons):>8.0f}  {ratio:>6.3f}  {noise:>6.3f}  "
                    f"{'PASS' if ok else 'FAIL'}",
                    flush=True,
                )
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
