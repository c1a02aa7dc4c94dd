"""Per-step cost of outrate's scheduler against stock vLLM 0.32.

    python benchmarks/bench_scheduler.py [--quick] [--check] [--no-profile]
                                         [--copies N] [--only CELLS]
    python benchmarks/bench_scheduler.py --isolated [--quick] [--only CELLS]
    python benchmarks/bench_scheduler.py --ablate [--quick] [--copies N] [--only CELLS]

What is timed: `schedule()` + `update_from_output()` of the REAL vLLM
`Scheduler` / `AsyncScheduler` (stock) and of `OutrateScheduler` /
`OutrateAsyncScheduler`, with a real KV cache manager, real `Request`s, a fake
clock that advances 10 ms per step and fabricated `ModelRunnerOutput`s (one
sampled token per scheduled request; async is fed one step behind, as the
engine's batch queue does). Building the fabricated output is not timed.
Every request is in decode when timing starts (admitted and prefilled during
warm-up) and has a max_tokens so large that nothing finishes. Every scheduler
gets max_num_seqs = R + 1: outrate keeps the last free seat for users with
budget, so at exactly R one throttled request would stay in the waiting queue
instead of running (held) like the others.

Why the ratios are what they are:

- 0% throttled: every user has a limit it never reaches (1e6 tok/s), so
  outrate charges every request every step but holds nobody. Compared with
  stock scheduling the same R requests: the pure price of the hooks
  (target <= 1.08: one store call per user and step, and a call per token
  that counts it, with no inline copy of either).
- f throttled: f*R requests belong to users at 0.001 tok/s (burst 100ms):
  after their first token they are held out of `running` for ~1000 s of fake
  time, i.e. for the whole run. The rest belong to 1e6 tok/s users. Compared
  with stock scheduling only the n requests outrate actually schedules per step
  (n measured from the outputs): what a step costs on top of the work that is
  really done (target <= 1.3 at 95%; the 50% rows are informative).
- Borrowers (a second table; `b100` / `b50` in `--only`): b*R requests
  belong to users with a committed rate of 0.001 tok/s and a `peak` above
  it, `unlimited` or 1e6 tok/s (`b100@1000000`: the excess bucket's GCRA
  runs per token, never refusing). After their first token every token they
  get is borrowed: each step `Lending.plan` runs, and each of their tokens
  takes the refusal path (a committed take that returns 0, then `borrow`).
  The rest belong to 1e6 tok/s users (committed). Every request is still
  scheduled every step (the benchmark checks that, and that every
  borrower's request is borrowing), so the ratio is over stock with all R
  running, as at 0%: what lending costs a step. No target.
- Prompt limits (issue 40; `p<N>` in `--only`, in the first table): every
  rule has a prompt limit; N users own one request each with a
  LONG_PROMPT-token prompt paced at PROMPT_PACE tok/s (a few tokens a step:
  still prefilling when the run ends), the others decode. Every request is
  scheduled every step: N paced chunks (the prompt charge, cut and trim of
  each) and R - N decodes. Stock gets the same requests and computes those
  prompts PACED_CHUNK tokens a step (`long_prefill_token_threshold`): the
  same work, so the ratio is over stock with all R running, as at 0%, and
  is what pacing adds. `p0`: the limits alone, everyone decoding. `pb<N>`:
  the same prompts with a prompt peak (committed at PROMPT_HALF, peak
  PROMPT_PACE: the same chunks, half of each borrowed, checked), so the
  lending plan runs every step and every chunk takes the borrow path: what
  a prompt peak adds. No target.
- Lending by step time (`t<borrow%>`, first table): borrower cells on a
  clock whose steps cost what they hold (TIMED_STEP: a fixed part and a part
  per request, the scheduler's fit given it as its prior), committed users
  at `committed_rate(R)` tok/s: the time target binds, so the step lends only
  part of the borrowers' requests and holds the rest (checked). Compared,
  like throttled cells, with stock scheduling the n requests outrate
  schedules. No target.

Noise: the machine is small and shared (other test runs come and go), and
two schedulers built alike differ by a few points (where their objects land
in memory), so (1) per-step times are taken with `time.perf_counter_ns` with
the garbage collector disabled (it runs between rounds, untimed); (2) every
scheduler gets the same requests (ids and prompts: the same dict layouts);
(3) each kind is built `--copies` times (3), alternately, each copy in a
rotated order; (4) all are
measured in many short interleaved rounds (A/B/C, B/C/A, C/A/B, ... 10 steps
each) so a neighbour's burst of load lands on all alike; (5) the us columns
are medians over copies of the medians over all timed steps, and `ratio` is
the median over rounds of the per-round ratio of the copies' medians
(paired: drift between rounds cancels), so it can differ a little from the
quotient of the columns. `a/a` is the same ratio between two sets of the
base's copies: what the cell reads when nothing differs. Rerun before
believing a FAIL within a/a's distance of its target.

How to read the table: `sched/step` is the median number of requests outrate
scheduled per step; `stock_all_us` is stock with all R requests running;
`stock_sched_us` is stock with only `sched/step` requests running (equal to
`stock_all_us` at 0%); `ratio` is `outrate_us` over `stock_all_us` at 0% and
over `stock_sched_us` otherwise. `users` is the number of users; with
throttling it reads `throttled+free` (a single user cannot be both, so U=1
rows with throttling use one throttled and one free user).

`--isolated` times outrate's own per-step code without the rest of the
step: its hook over every running request plus its end of step, against
stock's hook (which it replaces) over the same requests, alternating, as a
share of stock's full step. It separates what outrate's lines cost from
what a whole step adds around them (cache effects), which the end-to-end
ratio cannot.

`--ablate` measures, end to end like the grid, outrate variants that each
remove or heat one part of its per-step work (ABLATIONS): where the
difference from stock goes inside a whole step.

The profile section runs cProfile over a few hundred outrate steps of the
worst case (95% of 1024 throttled) and prints the top functions by cumulative
time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the vLLM harness lives with the tests

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm_harness import (  # noqa: E402
    BLOCK,
    FLAT_STEPS,
    MS,
    TOKEN,
    FakeClock,
    make_request,
    make_scheduler,
    model_dir,
)

from outrate.policy.compiler import CompiledPolicy, compile_policy  # noqa: E402
from outrate.policy.loader import parse_policy  # noqa: E402
from vllm_integration.offline.outputs import model_runner_output  # noqa: E402
from vllm_integration.step.steptime import Prior  # noqa: E402

PROMPT_LEN = 8
MAX_TOKENS = 1_000_000  # never reached: the run is far shorter
MAX_MODEL_LEN = 2048  # the harness's; a request stops when it gets there
STEP_NS = 10 * MS
PROBE_STEPS = 10  # untimed outrate steps that tell how many requests it schedules
FREE_RATE = "1000000"  # tok/s: never reached
SLOW_RATE = "0.001"  # tok/s: one token, then held for ~1000 s of fake time
TARGET_UNTHROTTLED = 1.08
TARGET_WORST = 1.3
PROMPT_PACE = "400"  # tok/s: ~4 prompt tokens a 10 ms step
PROMPT_HALF = "200"  # tok/s: a `pb` cell's committed prompt rate, its peak PROMPT_PACE
PACED_CHUNK = 4  # stock's chunk of those prompts (long_prefill_token_threshold): the same work
LONG_PROMPT = 1900  # ~475 steps to compute at 4 a step: more than a full run
TIMED_STEP = Prior(fixed_us=5000, per_decode_us=100, per_prefill_us=0)
"""The clock of `t` cells: 5 ms a step and 0.1 ms a request it holds."""


def committed_rate(running: int) -> str:
    """tok/s of a `t` cell's committed users (8 of them, R/16 streams each):
    the rate whose time target, `HEADROOM x (R/16) / rate`, is the step of
    the committed R/2 decodes and half the borrowers' R/2 (5 ms + 0.1 ms
    x 3R/4): about half the borrowers' requests fit (320 tok/s at R = 64)."""
    step_s = (TIMED_STEP.fixed_us + TIMED_STEP.per_decode_us * 3 * running / 4) / 1e6
    return str(round(0.8 * running / 16 / step_s))


@dataclass(frozen=True)
class Cell:
    mode: str  # "sync" | "async"
    running: int
    users: int
    throttled: float  # fraction of requests whose user is out of budget
    borrowing: float = 0.0  # fraction whose user is past its committed rate, below its peak
    peak: str = "unlimited"  # the borrowing users' peak (policy syntax)
    prompting: int | None = None  # prompt limits on: requests prefilling a paced prompt
    timed: bool = False  # borrowers lend by step time on a clock that costs the batch
    prompt_peak: bool = False  # the paced prompts half committed, half borrowed (pb<N>)

    @property
    def name(self) -> str:
        """How `--only` names the cell: mode:R:U:thr% or, with borrowers,
        mode:R:U:b<borrow%>, with @<peak> where the peak is finite; with
        prompt limits mode:R:U:p<prefilling>, pb<prefilling> with a prompt
        peak; lending by time mode:R:U:t<borrow%>."""
        head = f"{self.mode}:{self.running}:{self.users}"
        if self.prompting is not None:
            return f"{head}:{_kind(self)}"
        if self.timed:
            return f"{head}:t{self.borrowing * 100:.0f}"
        if not self.borrowing:
            return f"{head}:{self.throttled * 100:.0f}"
        finite = "" if self.peak == "unlimited" else f"@{self.peak}"
        return f"{head}:b{self.borrowing * 100:.0f}{finite}"


@dataclass(frozen=True)
class Sizes:
    warmup: int  # steps before timing (admission, prefill, first holds)
    rounds: int
    steps: int  # timed steps per scheduler per round

    @property
    def total(self) -> int:
        return self.warmup + self.rounds * self.steps


FULL = Sizes(warmup=30, rounds=40, steps=10)
COPIES = 3
"""Schedulers built per kind and cell. Two built alike differ by a few
points on this VM (where their objects land in memory); the median over
copies is what a cell's ratio reads."""
QUICK = Sizes(warmup=20, rounds=10, steps=5)


@dataclass
class Result:
    cell: Cell
    users_label: str
    scheduled: int
    stock_all_us: float
    stock_sched_us: float
    outrate_us: float
    ratio: float  # paired per round, over copies: see copies_ratio()
    aa: float = 1.0  # the base's twin over the base, measured alike: the noise floor

    @property
    def target(self) -> float | None:
        if self.cell.borrowing or self.cell.prompting is not None:
            return None
        if self.cell.throttled == 0:
            return TARGET_UNTHROTTLED
        if self.cell.throttled == 0.95:
            return TARGET_WORST
        return None

    @property
    def passed(self) -> bool | None:
        return None if self.target is None else self.ratio <= self.target


# -- workload ---------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    users: list[str]  # user of request i
    throttled_users: list[str]
    free_users: list[str]
    label: str
    borrowing_users: list[str] = field(default_factory=list)
    prompting_users: list[str] = field(default_factory=list)  # one long paced prompt each

    @property
    def n_throttled(self) -> int:
        slow = set(self.throttled_users)
        return sum(u in slow for u in self.users)

    @property
    def n_borrowing(self) -> int:
        lenders = set(self.borrowing_users)
        return sum(u in lenders for u in self.users)


def workload(running: int, users: int, throttled: float, borrowing: float = 0.0) -> Workload:
    """Who owns which request. Throttled (or borrowing) requests are spread
    evenly through the arrival order (not bunched at one end of `running`);
    within each group requests go round-robin over that group's users.
    Borrowing users are named b0, b1, ...; all requests may be theirs."""
    if not 1 <= users <= running:
        raise ValueError(f"need 1 <= users <= running, got users={users} running={running}")
    if throttled and borrowing:
        raise ValueError("a cell has throttled or borrowing users, not both")
    n_slow = round((throttled or borrowing) * running)
    if n_slow == 0:
        free = [f"u{i}" for i in range(users)]
        return Workload([free[i % users] for i in range(running)], [], free, str(users))
    if n_slow == running:
        if not borrowing:
            raise ValueError("at least one request must be unthrottled")
        lenders = [f"b{i}" for i in range(users)]
        owners = [lenders[i % users] for i in range(running)]
        return Workload(owners, [], [], str(users), lenders)
    k_slow = min(max(round((throttled or borrowing) * users), 1), max(users - 1, 1))
    k_free = max(users - k_slow, 1)
    slow = [f"{'b' if borrowing else 't'}{i}" for i in range(k_slow)]
    free = [f"u{i}" for i in range(k_free)]
    owners: list[str] = []
    i_slow = i_free = 0
    for i in range(running):
        if (i + 1) * n_slow // running != i * n_slow // running:
            owners.append(slow[i_slow % k_slow])
            i_slow += 1
        else:
            owners.append(free[i_free % k_free])
            i_free += 1
    if borrowing:
        return Workload(owners, [], free, f"{k_slow}+{k_free}", slow)
    return Workload(owners, slow, free, f"{k_slow}+{k_free}")


def prompt_workload(running: int, users: int, prompting: int) -> Workload:
    """`prompting` users own one request each (a long prompt, paced), spread
    through the arrival order; the other requests go round-robin over the
    rest of the users (u0, u1, ...)."""
    if not 0 <= prompting < min(users, running):
        raise ValueError(f"need 0 <= prompting < users, running; got {prompting}")
    free = [f"u{i}" for i in range(users - prompting)]
    slow = [f"p{i}" for i in range(prompting)]
    owners: list[str] = []
    i_slow = i_free = 0
    for i in range(running):
        if (i + 1) * prompting // running != i * prompting // running:
            owners.append(slow[i_slow])
            i_slow += 1
        else:
            owners.append(free[i_free % len(free)])
            i_free += 1
    return Workload(owners, [], free, f"{prompting}+{len(free)}", prompting_users=slow)


def prompt_lengths(w: Workload) -> list[int]:
    """Each request's prompt length: LONG_PROMPT for the prompting users'."""
    slow = set(w.prompting_users)
    return [LONG_PROMPT if u in slow else PROMPT_LEN for u in w.users]


def policy_for(
    w: Workload,
    peak: str = "unlimited",
    prompts: bool = False,
    committed: str = FREE_RATE,
    prompt_peak: bool = False,
) -> CompiledPolicy:
    """Throttled users at SLOW_RATE; borrowing users committed to SLOW_RATE
    with `peak` above it (one committed token, then every token borrowed);
    the others at `committed` (FREE_RATE: never reached). `prompts`: every
    rule limits prompts too, at FREE_RATE, and the prompting users' at
    PROMPT_PACE; with `prompt_peak`, at PROMPT_HALF with a peak of
    PROMPT_PACE: the same chunks, half of each borrowed."""
    mine = f", prompt: {FREE_RATE}" if prompts else ""
    lines = ["version: 1", f"default: {{rate: {FREE_RATE}{mine}}}", "burst: 100ms", "users:"]
    lines += [f"  {u}: {SLOW_RATE}" for u in w.throttled_users]
    lines += [f"  {u}: {{rate: {SLOW_RATE}, peak: {peak}}}" for u in w.borrowing_users]
    lines += [f"  {u}: {{rate: {committed}{mine}}}" for u in w.free_users]
    paced = f"{{rate: {PROMPT_HALF}, peak: {PROMPT_PACE}}}" if prompt_peak else PROMPT_PACE
    lines += [f"  {u}: {{rate: {FREE_RATE}, prompt: {paced}}}" for u in w.prompting_users]
    text = "\n".join(lines) + "\n"
    return compile_policy(parse_policy(text, "bench.yaml"), "bench.yaml")


# -- driving one scheduler ----------------------------------------------------


@dataclass(eq=False)
class Bench:
    """One scheduler stepped like the engine steps it, timing only the
    scheduler's own calls."""

    name: str
    sched: Any
    clock: FakeClock
    rounds: list[list[int]] = field(default_factory=list)  # ns per step, per round
    scheduled: list[int] = field(default_factory=list)
    _pending: deque = field(default_factory=deque)
    cost: Prior | None = None  # the clock's step cost (None: STEP_NS flat)

    @property
    def is_async(self) -> bool:
        return isinstance(self.sched, AsyncScheduler)

    def step(self) -> tuple[int, int]:
        """One engine step: (ns spent in the scheduler, requests scheduled)."""
        sched = self.sched
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        ids = list(out.num_scheduled_tokens)
        reqs = sched.requests
        mro = model_runner_output(ids, [[] if reqs[r].is_prefill_chunk else [TOKEN] for r in ids])
        pending = self._pending
        pending.append((out, mro))
        spent = t1 - t0
        if not ids:  # nothing new in flight: collect what is (as the engine does)
            while pending:
                spent += self._deliver()
        elif not self.is_async or len(pending) >= 2:
            spent += self._deliver()
        cost = self.cost
        if cost is None:
            self.clock.advance(STEP_NS)
        else:
            us = cost.fixed_us + cost.per_decode_us * len(ids)
            self.clock.advance(
                int((us + cost.per_prefill_us * out.total_num_scheduled_tokens) * 1000)
            )
        return spent, len(ids)

    def _deliver(self) -> int:
        out, mro = self._pending.popleft()
        t0 = time.perf_counter_ns()
        self.sched.update_from_output(out, mro)
        return time.perf_counter_ns() - t0

    def run(self, steps: int, record: bool = True) -> None:
        times, scheduled = [], []
        for _ in range(steps):
            ns, n = self.step()
            times.append(ns)
            scheduled.append(n)
        if record:
            self.rounds.append(times)
            self.scheduled += scheduled

    def median_us(self) -> float:
        return statistics.median(t for r in self.rounds for t in r) / 1000

    def reset(self) -> None:
        self.rounds.clear()
        self.scheduled.clear()

    def median_scheduled(self) -> int:
        return round(statistics.median(self.scheduled))


def build(
    kind: str,
    owners: Sequence[str | None],
    sizes: Sizes,
    policy: CompiledPolicy | None,
    lengths: Sequence[int] | None = None,
    cost: Prior | None = None,
    chunk: int = 0,
) -> Bench:
    """A scheduler with len(owners) running requests, warmed up into decode
    (but the long prompts, which `policy` paces or stock computes `chunk`
    tokens a step). `lengths`: each request's prompt length (PROMPT_LEN);
    `cost`: the clock's step cost, also the scheduler's prior of it (a flat
    STEP_NS)."""
    r = len(owners)
    lengths = list(lengths) if lengths is not None else [PROMPT_LEN] * r
    clock = FakeClock()
    tokens = max(PROMPT_LEN + sizes.total + PROBE_STEPS + 4, max(lengths) + 1)  # the most
    if tokens >= MAX_MODEL_LEN:
        raise ValueError(f"{sizes.total} steps would run requests into max_model_len")
    extra = sum(lengths) - PROMPT_LEN * r  # the long prompts' tokens
    per_req_blocks = -(-(PROMPT_LEN + sizes.total + PROBE_STEPS + 4) // BLOCK) + 1
    sched = make_scheduler(
        kind,
        policy,
        clock,
        num_blocks=r * per_req_blocks + 64 + -(-extra // BLOCK) + r,
        step_model=cost or FLAT_STEPS,
        max_num_seqs=r + 1,  # see module docstring: the last free seat
        max_num_batched_tokens=max(r * PROMPT_LEN, 256) + extra,
        scheduler={
            "long_prefill_token_threshold": chunk,
            "long_prefill_token_threshold_adaptive": False,
        }
        if chunk
        else None,
    )
    bench = Bench(kind, sched, clock, cost=cost)
    for i, user in enumerate(owners):
        n = lengths[i]
        sched.add_request(make_request(user, n, MAX_TOKENS, prompt=prompt(i, n), req_id=f"q{i}"))
    bench.run(sizes.warmup, record=False)
    paced = sum(n > PROMPT_LEN for n in lengths) if policy is not None or chunk else 0
    if cost is None:  # (lent by time, a borrower's new prompt may wait for spare time)
        _check_settled(bench, r, paced)
    return bench


def prompt(i: int, n: int = PROMPT_LEN) -> list[int]:
    """Request i's prompt of `n` tokens, the same in every scheduler and
    distinct for each i (its first two tokens spell i in base 497): copies
    see identical requests."""
    return [3 + i % 497, 3 + i // 497 % 497] + [3 + (i * 31 + j) % 497 for j in range(n - 2)]


def _check_settled(bench: Bench, r: int, prefilling: int = 0) -> None:
    """Every request running, all in decode but `prefilling` (paced prompts)."""
    sched = bench.sched
    running, waiting = sched.get_request_counts()
    if waiting or running != r:
        raise RuntimeError(
            f"{bench.name}: not settled after warm-up: {running} running, {waiting} waiting"
        )
    busy = [q for q in sched.running if q.is_prefill_chunk]
    if len(busy) != prefilling:
        raise RuntimeError(
            f"{bench.name}: {len(busy)} requests prefilling after warm-up, not {prefilling}"
        )


def interleave(benches: Sequence[Bench], sizes: Sizes) -> None:
    """Short rounds, A/B/C then B/C/A then C/A/B ...: each scheduler runs
    `sizes.steps` steps per round and takes every position in turn, so load
    from neighbours lands on all of them alike. The collector is off while
    steps run and collects between rounds, outside the timed calls."""
    k = len(benches)
    gc.collect()
    gc.disable()
    try:
        for rnd in range(sizes.rounds):
            for j in range(k):
                benches[(rnd + j) % k].run(sizes.steps)
            gc.enable()
            gc.collect()
            gc.disable()
    finally:
        gc.enable()


def paired_ratio(a: Bench, b: Bench) -> float:
    """Median over rounds of (a's median / b's median) in the same round:
    both ran within milliseconds of each other, so slow drift cancels."""
    return copies_ratio([a], [b])


def copies_ratio(a: Sequence[Bench], b: Sequence[Bench]) -> float:
    """`paired_ratio` over copies: per round, the median of `a`'s copies'
    medians over the same of `b`'s; the median over rounds."""
    return statistics.median(
        statistics.median(statistics.median(x.rounds[i]) for x in a)
        / statistics.median(statistics.median(y.rounds[i]) for y in b)
        for i in range(len(a[0].rounds))
    )


def prompt_borrowed(b: Bench) -> int:
    """Prompt tokens the bench's scheduler lent so far (a `pb` cell's check)."""
    return sum(m.prompt_borrowed for m in b.sched.metrics.labels.values())


def copies_us(copies: Sequence[Bench]) -> float:
    return statistics.median(c.median_us() for c in copies)


def measure(cell: Cell, sizes: Sizes, copies: int = COPIES) -> Result:
    """`copies` schedulers of each kind, built alternately, all stepped in
    the same interleaved rounds. The base is stock with all R requests at
    0% throttled, stock with the n requests outrate schedules otherwise; its
    twin (built alike, measured alike) gives `a/a`, the cell's noise floor.
    With borrowers the base is stock with all R, as at 0%: every request is
    scheduled, every borrower's borrowing (checked). With prompt limits
    (`p` cells) stock gets the same requests, long prompts included: all R,
    as at 0%. Lending by time (`t` cells): stock with n, as when throttled."""
    prompts = cell.prompting is not None
    if prompts:
        w = prompt_workload(cell.running, cell.users, cell.prompting or 0)
    else:
        w = workload(cell.running, cell.users, cell.throttled, cell.borrowing)
    lengths = prompt_lengths(w)
    cost = TIMED_STEP if cell.timed else None
    committed = committed_rate(cell.running) if cell.timed else FREE_RATE
    pol = policy_for(w, cell.peak, prompts, committed, cell.prompt_peak)

    def probed() -> Bench:
        b = build(cell.mode, w.users, sizes, pol, lengths, cost)
        b.run(PROBE_STEPS)  # n: what outrate schedules once the throttled are held
        lent = len(b.sched.lending)
        if cell.timed and not 0 < lent < w.n_borrowing:  # the time target binds
            raise RuntimeError(f"{cell.name}: {lent} of {w.n_borrowing} requests borrowing")
        if not cell.timed and lent != w.n_borrowing:
            raise RuntimeError(f"{cell.name}: {lent} requests borrowing, not {w.n_borrowing}")
        if cell.prompt_peak and not prompt_borrowed(b):  # the borrow path runs every step
            raise RuntimeError(f"{cell.name}: no prompt token borrowed")
        return b

    outs = [probed()]
    n = outs[0].median_scheduled()
    if (cell.borrowing and not cell.timed or prompts) and n != cell.running:
        raise RuntimeError(f"{cell.name}: {n} of {cell.running} requests scheduled per step")
    stock = f"stock-{cell.mode}"
    alls: list[Bench] = []
    bases: list[Bench] = []
    twins: list[Bench] = []
    full = cell.throttled == 0 and not cell.timed  # the base: stock with all R
    same = lengths if full else None  # (n == R: the same requests)
    chunk = PACED_CHUNK if prompts else 0  # stock computes the long prompts as paced

    def base() -> None:
        if full or not alls:  # informational when throttled: one copy
            alls.append(build(stock, [None] * cell.running, sizes, None, same, chunk=chunk))
        bases.append(alls[-1] if full else build(stock, [None] * n, sizes, None))

    makers = (
        lambda: outs.append(probed()),
        base,
        lambda: twins.append(build(stock, [None] * n, sizes, None, same, chunk=chunk)),
    )
    base()  # outrate's first copy came first (it tells n); then each copy in a rotated order
    twins.append(build(stock, [None] * n, sizes, None, same, chunk=chunk))
    for c in range(1, copies):
        for j in range(3):
            makers[(c + j) % 3]()
    for b in outs:
        b.reset()
    benches = [b for group in zip(outs, bases, twins, strict=True) for b in group]
    interleave(benches + [b for b in alls if b not in bases], sizes)
    return Result(
        cell=cell,
        users_label=w.label,
        scheduled=round(statistics.median(b.median_scheduled() for b in outs)),
        stock_all_us=copies_us(alls),
        stock_sched_us=copies_us(bases),
        outrate_us=copies_us(outs),
        ratio=copies_ratio(outs, bases),
        aa=copies_ratio(twins, bases),
    )


# -- grid and report ----------------------------------------------------------


BORROWERS = ((1.0, "unlimited"), (1.0, FREE_RATE), (0.5, "unlimited"))
"""The borrower cells (borrowing fraction, the borrowers' peak), 16 users, at
R = 64 and 256 in both grids."""


def grid(quick: bool) -> list[Cell]:
    runnings = (64, 256) if quick else (64, 256, 1024)
    users = (16,) if quick else (1, 16, 256)
    modes = ("sync", "async")
    limited = [
        Cell(mode, r, u, f)
        for mode in modes
        for r in runnings
        for u in users
        if u <= r
        for f in (0.0, 0.5, 0.95)
    ]
    lending = [
        Cell(mode, r, 16, 0.0, part, peak)
        for mode in modes
        for r in (64, 256)
        for part, peak in BORROWERS
    ]
    return limited + lending


COST_CELLS = (
    (None, False, 0.0, False),
    (0, False, 0.0, False),
    (8, False, 0.0, False),
    (8, False, 0.0, True),
    (None, True, 0.5, False),
)
"""Issue 40's cells (prompting, timed, borrowing, prompt peak), 16 users, R =
64 and 256: the 0% cell beside them (the same run's price of the hooks),
prompt limits with everyone decoding (p0), with 8 paced prompts (p8), and
with those prompts half borrowed under a prompt peak (pb8: the lending plan
runs every step, each chunk takes the borrow path), and lending by step
time with half the requests borrowing (t50)."""


def cost_grid() -> list[Cell]:
    """Prompt limits and lending by time (issue 40): `--cost` runs them, and
    `--only` may name them."""
    return [
        Cell(mode, r, 16, 0.0, part, prompting=p, timed=t, prompt_peak=pp)
        for mode in ("sync", "async")
        for r in (64, 256)
        for p, t, part, pp in COST_CELLS
    ]


HEADER = """\
Per-step cost of schedule() + update_from_output(), median us, all requests in decode.
stock_all: stock vLLM with all R running.  stock_sched: stock vLLM with only the
requests outrate actually schedules (sched/step).  ratio = outrate / stock_all at 0%
throttled (price of the hooks), outrate / stock_sched otherwise (price of the held).
a/a: a second set of stock_sched copies over the first, measured alike (the noise
floor).  users: count, or throttled+free users when some are throttled.
thr% p<N>: prompt limits on every rule, N users each prefilling one paced prompt
(prompting+decoding users; ratio over stock with the same requests, all R);
pb<N>: the same prompts under a prompt peak, half of each chunk borrowed.
thr% t<B>: B% of the requests borrowing, lent by step time on a costed clock
(borrowing+committed users; ratio over stock with the n scheduled)."""

COLUMNS = {
    "mode": 5, "R": 5, "users": 7, "thr%": 4, "sched/step": 10, "stock_all_us": 12,
    "stock_sched_us": 14, "outrate_us": 10, "ratio": 6, "a/a": 6, "target": 6, "result": 6,
}  # fmt: skip


def format_row(values: Iterable[str], columns: dict[str, int] = COLUMNS) -> str:
    return "  ".join(v.rjust(w) for v, w in zip(values, columns.values(), strict=True))


BORROW_HEADER = """\
Borrowers: users committed to 0.001 tok/s with a peak above it (unlimited, or the
rate shown), out of their committed rate, so every token they get is borrowed
(Lending.plan each step).  borrow%: their share of the R requests; the rest are
committed users (1e6 tok/s); users: count, or borrowing+committed users.  All R
are scheduled every step, so ratio = outrate / stock with all R running: what
lending adds to a step.  No target."""

BORROW_COLUMNS = {
    "mode": 5, "R": 5, "users": 7, "borrow%": 7, "peak": 9, "sched/step": 10,
    "stock_all_us": 12, "outrate_us": 10, "ratio": 6, "a/a": 6,
}  # fmt: skip


def format_table(results: Iterable[Result]) -> str:
    results = list(results)
    limited = [r for r in results if not r.cell.borrowing or r.cell.timed]
    lending = [r for r in results if r.cell.borrowing and not r.cell.timed]
    lines = [HEADER, "", format_row(COLUMNS)] if limited or not lending else []
    for res in limited:
        c = res.cell
        row = [c.mode, str(c.running), res.users_label, _kind(c)]
        row.append(str(res.scheduled))
        row += [f"{us:.0f}" for us in (res.stock_all_us, res.stock_sched_us, res.outrate_us)]
        row.append(f"{res.ratio:.3f}")
        row.append(f"{res.aa:.3f}")
        row.append("-" if res.target is None else f"<={res.target:g}")
        row.append({None: "-", True: "PASS", False: "FAIL"}[res.passed])
        lines.append(format_row(row))
    if lending:
        if lines:
            lines.append("")
        lines += [BORROW_HEADER, "", format_row(BORROW_COLUMNS, BORROW_COLUMNS)]
    for res in lending:
        c = res.cell
        row = [c.mode, str(c.running), res.users_label, f"{c.borrowing * 100:.0f}", c.peak]
        row += [str(res.scheduled), f"{res.stock_all_us:.0f}", f"{res.outrate_us:.0f}"]
        row += [f"{res.ratio:.3f}", f"{res.aa:.3f}"]
        lines.append(format_row(row, BORROW_COLUMNS))
    return "\n".join(lines)


def _kind(c: Cell) -> str:
    """The first table's thr% column: throttled %, p<prompting> or t<borrow%>."""
    if c.prompting is not None:
        return f"{'pb' if c.prompt_peak else 'p'}{c.prompting}"
    if c.timed:
        return f"t{c.borrowing * 100:.0f}"
    return f"{c.throttled * 100:.0f}"


def profile_worst(mode: str = "sync", users: int = 16, steps: int = 300, top: int = 15) -> str:
    """cProfile of outrate's own scheduler calls at 95% of 1024 throttled."""
    w = workload(1024, users, 0.95)
    sizes = Sizes(warmup=FULL.warmup, rounds=1, steps=steps)
    bench = build(mode, w.users, sizes, policy_for(w))
    prof = cProfile.Profile()
    sched = bench.sched
    for name in ("schedule", "update_from_output"):
        setattr(sched, name, _profiled(prof, getattr(sched, name)))
    gc.disable()
    try:
        bench.run(steps)
    finally:
        gc.enable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    head = (
        f"cProfile: outrate {mode}, R=1024, users {w.label}, 95% throttled, {steps} steps, "
        f"median {bench.median_scheduled()} scheduled/step (profiler overhead inflates times)"
    )
    return head + "\n" + buf.getvalue().strip()


def _profiled(prof: cProfile.Profile, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        prof.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.disable()

    return call


def isolated(cell: Cell, sizes: Sizes, reps: int = 200) -> tuple[float, float, float, float]:
    """outrate's own per-step code without the rest of a step around it: on
    a warmed outrate scheduler, its charging hook over every running request
    plus `_after_schedule` (refunds, holds, fold, cleanup); on a warmed stock
    scheduler with the same requests, stock's hook that it replaces, over
    its requests. Alternating, `reps` times each. Returns (stock's full
    step in us, ours in ns, stock's hook in ns, their median difference in
    ns). What the end-to-end ratio cannot separate from a step's cache
    effects, this times directly; those effects are not in it."""
    w = workload(cell.running, cell.users, cell.throttled)
    ours = build(cell.mode, w.users, sizes, policy_for(w))
    stock = build(f"stock-{cell.mode}", [None] * cell.running, sizes, None)
    interleave([ours, stock], Sizes(0, 10, 10))
    step_us = stock.median_us()
    clock = time.perf_counter_ns

    def inputs(b: Bench) -> tuple[list[Any], list[int], dict[str, int]]:
        reqs = list(b.sched.running)  # all in decode, none held: the same every step
        return reqs, [len(q._all_token_ids) - 1 for q in reqs], {q.request_id: 1 for q in reqs}

    fed = {id(ours): inputs(ours), id(stock): inputs(stock)}

    def loop(b: Bench, after: bool) -> int:
        sched = b.sched
        reqs, computed, scheduled = fed[id(b)]
        hook = sched._reserve_prefill_lookahead
        if after:
            sched._step += 1
            sched._now += STEP_NS
        t0 = clock()
        if after:
            sched.ledger.begin(sched._now)  # (schedule() starts each step with it)
        for q, c in zip(reqs, computed, strict=True):
            hook(q, c, 1)
        if after:
            sched._after_schedule(scheduled, sched._now, len(sched.running))
        return clock() - t0

    mine, theirs, diff = [], [], []
    gc.disable()
    try:
        for i in range(reps):
            if i % 2:
                a, c = loop(ours, True), loop(stock, False)
            else:
                c, a = loop(stock, False), loop(ours, True)
            mine.append(a)
            theirs.append(c)
            diff.append(a - c)
    finally:
        gc.enable()
    med = statistics.median
    return step_us, med(mine), med(theirs), med(diff)


ABLATIONS = {
    "shipped": "outrate as shipped",
    "hot-bucket": "every user charges one shared bucket (the store's state stays hot)",
    "no-store": "every take a call to take_upto, which answers without state (no bucket)",
    "hot-label": "every user counted under one shared label record (metrics state hot)",
    "no-metrics": "the hook without its metric lines (Ledger.charge a no-op: bench_metrics)",
    "bare": "outrate's scheduler with stock's hook and no end of step",
}
"""`--ablate`: outrate variants, each built and measured like the others,
that remove or heat one part of its per-step work. What a variant saves
against `shipped` is what that part costs inside a whole step; a `hot-*`
variant that saves nothing says the part's cost is its lines, not cold
state."""


def _ablated(sched: Any, name: str) -> None:
    if name == "hot-bucket":  # limits never reached: one bucket serves everyone
        shared = sched.limiter.pin("ablate/shared")
        for u in sched._users.values():
            u.bucket = shared
    elif name == "no-store":
        sched.limiter.take_upto = lambda b, now, n: n
        sched.limiter.give_back = lambda b, now, n=1: None
    elif name == "hot-label":
        from outrate.observe.metrics import LabelMetrics

        label = LabelMetrics("ablate/shared")
        for u in sched._users.values():
            u.m = label
    elif name == "no-metrics":
        without_metrics(sched)
    elif name == "bare":
        stock = type(sched).__mro__[2]  # Scheduler / AsyncScheduler, after OutrateMixin
        sched._reserve_prefill_lookahead = types.MethodType(stock._reserve_prefill_lookahead, sched)
        sched._after_schedule = lambda scheduled, now, visited: None
    elif name != "shipped":
        raise ValueError(f"unknown ablation {name!r}")


def without_metrics(sched: Any) -> None:
    """The shipped scheduler with `Ledger.charge` (a token's count and
    interval: every metric line of the hook) only keeping the request's
    last token time: the benchmark times the hook it ships, minus what it
    measures (bench_metrics.py's baseline, and the `no-metrics` ablation)."""
    sched.ledger.charge = no_charge


def no_charge(rs: Any, u: Any, now: int) -> None:
    rs.last_ns = now  # (the request's last token time only: nothing counted)


def ablate(cell: Cell, sizes: Sizes, copies: int = COPIES) -> dict[str, float]:
    """Each variant of ABLATIONS against stock with the same requests (0%
    throttled: `cell.throttled` is ignored), plus `a/a`; every set built
    `copies` times in a rotated order and run in the same interleaved
    rounds. Returns ratio per name."""
    w = workload(cell.running, cell.users, 0.0)
    groups: dict[str, list[Bench]] = {"stock": [], "a/a": [], **{n: [] for n in ABLATIONS}}
    names = list(groups)
    for c in range(copies):
        for j in range(len(names)):
            name = names[(c + j) % len(names)]
            if name in ("stock", "a/a"):
                groups[name].append(build(f"stock-{cell.mode}", [None] * cell.running, sizes, None))
            else:
                b = build(cell.mode, w.users, sizes, policy_for(w))
                _ablated(b.sched, name)
                groups[name].append(b)
    interleave([b for group in zip(*groups.values(), strict=True) for b in group], sizes)
    base = groups["stock"]
    return {name: copies_ratio(group, base) for name, group in groups.items() if name != "stock"}


def main_ablate(args: Any) -> int:
    sizes = QUICK if args.quick else FULL
    cells = args.only.split(",") if args.only else ["sync:256:256:0", "async:256:256:0"]
    print("outrate variants over stock, 0% throttled (ratio of step cost, paired rounds):")
    for name, what in ABLATIONS.items():
        print(f"  {name:>10}: {what}")
    print(f"{'cell':>16}  " + "  ".join(f"{n:>10}" for n in ("a/a", *ABLATIONS)))
    for spec in cells:
        mode, r, u, *_ = spec.split(":")
        res = ablate(Cell(mode, int(r), int(u), 0.0), sizes, max(args.copies, 1))
        print(f"{spec:>16}  " + "  ".join(f"{res[n]:>10.3f}" for n in res), flush=True)
    return 0


def main_isolated(args: Any) -> int:
    sizes = QUICK if args.quick else FULL
    print("outrate's own code per step, none throttled: its hook over every running")
    print("request plus _after_schedule, against stock's hook over the same requests")
    print("(median ns, alternating); share = the difference over stock's full step.")
    print(
        f"{'mode':>5}  {'R':>5}  {'users':>5}  {'stock step us':>13}  {'ours ns':>8}  "
        f"{'stock hook':>10}  {'diff ns':>8}  {'ns/req':>6}  {'share':>6}"
    )
    for cell in grid(args.quick):
        if cell.throttled or cell.borrowing:
            continue
        if args.only and cell.name not in args.only.split(","):
            continue
        step_us, mine, theirs, diff = isolated(cell, sizes)
        print(
            f"{cell.mode:>5}  {cell.running:>5}  {cell.users:>5}  {step_us:>13.0f}  {mine:>8.0f}  "
            f"{theirs:>10.0f}  {diff:>8.0f}  {diff / cell.running:>6.0f}  "
            f"{diff / 1000 / step_us:>6.2%}",
            flush=True,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="reduced grid and steps (CI smoke)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile section")
    ap.add_argument(
        "--cost",
        action="store_true",
        help="the cells of prompt limits (p0, p8) and lending by step time (t50) instead",
    )
    ap.add_argument("--copies", type=int, default=COPIES, help="schedulers built per kind")
    ap.add_argument(
        "--only",
        help="cells, e.g. sync:1024:16:0,async:256:256:0 (mode:R:U:thr%%), "
        "async:64:16:b100,sync:256:16:b100@1000000 (borrowers: mode:R:U:b<borrow%%>[@peak])",
    )
    ap.add_argument(
        "--isolated",
        action="store_true",
        help="time outrate's own per-step code (hook + end of step) against stock's hook",
    )
    ap.add_argument(
        "--ablate",
        action="store_true",
        help="outrate variants without (or with hot) store, metrics fold, hook: cost split",
    )
    args = ap.parse_args(argv)
    if args.ablate:
        with contextlib.redirect_stdout(sys.stderr):
            model_dir()
        return main_ablate(args)
    if args.isolated:
        with contextlib.redirect_stdout(sys.stderr):
            model_dir()
        return main_isolated(args)
    sizes = QUICK if args.quick else FULL
    with contextlib.redirect_stdout(sys.stderr):
        model_dir()  # builds or reuses the tiny model; keep its chatter off the table
    results = []
    cells = cost_grid() if args.cost else grid(args.quick)
    if args.only and not args.cost:  # any cell by name
        cells += [c for c in cost_grid() if c.name not in {g.name for g in cells}]
    for cell in cells:
        if args.only and cell.name not in args.only.split(","):
            continue
        results.append(measure(cell, sizes, max(args.copies, 1)))
        print(
            f"  measured {cell.name}: ratio {results[-1].ratio:.3f} a/a {results[-1].aa:.3f}",
            file=sys.stderr,
            flush=True,
        )
    print(format_table(results))
    if not args.quick and not args.no_profile:
        print()
        print(profile_worst())
    failed = [r for r in results if r.passed is False]
    if failed:
        print(f"\n{len(failed)} target(s) missed", file=sys.stderr)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
