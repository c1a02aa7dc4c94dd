"""Real vLLM schedulers sharing one budget through a real store, for the
store tests (test_scheduler_store.py, test_store_faults.py): each "engine" is
vLLM's own scheduler and KV cache manager, its own `SharedBudget`, table and
lease thread (`LeaseRunner`), with fabricated model outputs (vllm_harness).
Time is real: the global GCRA runs on the store's TIME, so the schedulers use
CLOCK_MONOTONIC (one clock on one machine) and are stepped every few ms.
What each scheduler charged is recorded (`Recorder`) and merged over the
engines to check a bound per window. As in the engine core
(vllm_integration/enginecore/store.py), the prompt table is shared too, by
the same lease thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from redis.connection import AbstractConnection
from vllm_harness import Driver, make_request, make_scheduler

from outrate.budget.limiter import Limiter
from outrate.budget.shared.credit import SharedBudget
from outrate.budget.shared.lease import RedisLink
from outrate.budget.shared.runner import LeaseRunner
from outrate.policy.compiler import compile_policy
from outrate.policy.loader import parse_policy

POLICY = "version: 1\ndefault: unlimited\nburst: 100ms\nusers:\n  alice: 20\n"
RATE = 20
BURST_NS = 100_000_000


class Recorder:
    """Stands in for the TraceWriter: keeps every step's charges."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def step(self, entry: tuple) -> None:
        self.steps.append(entry)

    def event(self, t: int, **fields: object) -> None:
        pass

    def prompt_tokens(
        self, user: str, since: int = 0, until: int | None = None
    ) -> list[tuple[int, int]]:
        """(time, prompt tokens computed) of each step that computed some of `user`'s."""
        out = []
        for t, *rest in self.steps:
            n = rest[10].get(user, 0)  # the line's prompt tokens (net of refunds)
            if n and t >= since and (until is None or t < until):
                out.append((t, n))
        return out

    def tokens(self, user: str, since: int = 0, until: int | None = None) -> list[tuple[int, int]]:
        out = []
        for t, _, _, charged, refunded, *_ in self.steps:  # (time, step, running, ...)
            n = charged.get(user, 0) - refunded.get(user, 0)
            if n and t >= since and (until is None or t < until):
                out.append((t, n))
        return out


class Engine:
    """One scheduler, its lease thread and what it charged."""

    def __init__(
        self, kind: str, url: str, name: str, policy: str = POLICY, **runner_kw: Any
    ) -> None:
        pol = compile_policy(parse_policy(policy, "t.yaml"), "t.yaml", "sha-t")
        self.sched = make_scheduler(kind)
        fallback = runner_kw.pop("fallback", "local")
        self.budget = SharedBudget(fallback=fallback)
        self.limiter = Limiter(pol, lender=self.budget)
        self.pbudget = SharedBudget(fallback=fallback)
        self.prompts = Limiter(pol.prompts, lender=self.pbudget)
        # CLOCK_MONOTONIC
        self.sched.outrate_configure(pol, limiter=self.limiter, prompt_table=self.prompts)
        self.runner = LeaseRunner(
            self.limiter,
            self.budget,
            RedisLink(url),
            policy_sha=lambda: pol.sha256,
            engine=name,
            prompts=(self.prompts, self.pbudget),
            **runner_kw,
        )
        self.rec = Recorder()
        self.sched.outrate_trace(self.rec)
        self.driver = Driver(self.sched)
        self.slowest_ns = 0
        """The longest scheduler step `run` saw (printed: a machine's stall shows here too)."""
        self.store_calls_in_steps = 0
        """Connections opened and commands sent to the store from inside this
        engine's scheduler steps during `run`: 0 when no step waits on the
        store (only the lease thread talks to it)."""

    def start(self) -> Engine:
        self.runner.start()
        return self

    def add(self, user: str, streams: int) -> None:
        for _ in range(streams):
            self.driver.add(make_request(user, max_tokens=100_000))

    def feed(self, user: str, live: int, prompt_len: int) -> None:
        """Keep `live` requests of `user` with `prompt_len`-token prompts and
        one output token each in this engine: a new one for each that finished."""
        d = self.driver
        mine = [r for r, u in d.user_of.items() if u == user and r not in d.finished]
        for _ in range(live - len(mine)):
            d.add(make_request(user, prompt_len=prompt_len, max_tokens=1))


_stepping = threading.local()
"""The engine whose step `run` is in, on the stepping thread (None elsewhere)."""


@contextlib.contextmanager
def _store_calls_counted() -> Iterator[None]:
    """While open, every redis-py connection opened or command sent from
    inside an engine's step counts in its `store_calls_in_steps`."""
    saved = {n: getattr(AbstractConnection, n) for n in ("connect", "send_packed_command")}

    def watch(original: Callable[..., Any]) -> Callable[..., Any]:
        def watched(self: Any, *args: Any, **kw: Any) -> Any:
            e = getattr(_stepping, "engine", None)
            if e is not None:
                e.store_calls_in_steps += 1
            return original(self, *args, **kw)

        return watched

    for name, original in saved.items():
        setattr(AbstractConnection, name, watch(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(AbstractConnection, name, original)


def run(
    engines: list[Engine],
    seconds: float,
    events: list[tuple[float, Callable[[], None]]] = (),
    gap_s: float = 0.004,
) -> dict[str, int]:
    """Step every engine every `gap_s` for `seconds`; at each (t, action) run
    the action (in a thread: a failover takes seconds, steps go on). Returns
    when each action started (monotonic ns), by its function's name, and
    records each engine's slowest step (`Engine.slowest_ns`) and the store
    calls its steps made (`Engine.store_calls_in_steps`)."""

    marks: dict[str, int] = {}
    t0 = time.monotonic()
    pending = sorted(events, key=lambda e: e[0])
    threads = []
    until = t0 + seconds
    with _store_calls_counted():
        while time.monotonic() < until:
            while pending and time.monotonic() - t0 >= pending[0][0]:
                _, action = pending.pop(0)
                marks[action.__name__] = time.monotonic_ns()
                th = threading.Thread(target=action, daemon=True)
                th.start()
                threads.append(th)
            for e in engines:
                t = time.perf_counter_ns()
                _stepping.engine = e
                try:
                    e.driver.step()
                finally:
                    _stepping.engine = None
                e.slowest_ns = max(e.slowest_ns, time.perf_counter_ns() - t)
            time.sleep(gap_s)
    for th in threads:
        th.join(timeout=30)
    return marks


def longest_gap_ms(steps: list[tuple[int, int]]) -> float:
    return max((b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False)), default=0) / 1e6
