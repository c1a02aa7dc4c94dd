"""How big a simulation is before it runs: requests, tokens, steps, memory
and wall time, estimated from the workload, the engine and the step model.

A valid workload can ask for days of traffic (`duration: 168h` with
`rate: 100000` is sixty billion requests). The command states the size up
front and refuses, with the reason, a plan that would not fit in memory,
before anything is drawn: the open-loop arrivals are planned whole, and the
record keeps every token's time.

Estimates, not bounds: a closed-loop stream is counted as if never
throttled (its requests as fast as full-batch steps allow), so a policy that
slows it makes the run smaller, not larger. The wall time per step was
measured with benchmarks/bench_simulate.py on the 2-core machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from outrate.errors import OutrateError
from outrate.simulate.engine import EngineSpec
from outrate.simulate.stepmodel import StepModel
from outrate.simulate.workload import Workload

WALL_PER_STEP_US = 250.0
WALL_PER_SCHEDULED_US = 10.0
"""Wall time a simulated step costs: vLLM's schedule() and update_from_output()
with outrate's hooks, the fabricated output and the record (about 0.85 ms a
step at a batch of ~60 in bench_simulate on the 2-core machine)."""
BYTES_PER_TOKEN = 80
"""A token's time and gap in the record (two list entries and two ints)."""
BYTES_PER_REQUEST = 400
"""A planned request (its spec and ids), beside its prompt's token ids."""
BYTES_PER_PROMPT_TOKEN = 8
MEMORY_SHARE = 0.8
"""A plan may use this share of the memory available when it starts."""


@dataclass(frozen=True)
class Size:
    requests: int
    tokens: int
    steps: int
    memory_bytes: int
    wall_s: float
    """Requests to wall time: one run's."""
    runs: int = 1

    def describe(self) -> str:
        each = f" a run, {self.runs} runs" if self.runs > 1 else ""
        return (
            f"plan: about {self.requests:,} requests, {self.tokens:,} output tokens, "
            f"{self.steps:,} steps{each}; about {_duration(self.wall_s * self.runs)} of wall "
            f"time and {_bytes(self.memory_bytes * self.runs)} of memory"
        )


def size_of(workload: Workload, engine: EngineSpec, model: StepModel) -> Size:
    users = workload.expanded()
    streams = sum(load.streams or 0 for _, load in users)
    slots = min(engine.max_num_seqs, engine.max_num_active_seqs or engine.max_num_seqs)
    batch = max(min(streams + sum(1 for _, u in users if u.rate), slots), 1)
    step_s = model.step_ns(batch, 0) / 1e9
    steps = workload.duration / 1e9 / step_s
    prompt_tokens = 0.0
    open_loop = [0.0, 0.0]  # requests, tokens
    closed = [0.0, 0.0]
    for _, load in users:
        stop = workload.duration if load.stop is None else min(load.stop, workload.duration)
        window = max(stop - load.start, 0) / 1e9
        if load.rate is not None:
            n = load.rate * window
            prompt_tokens += n * load.prompt.mean
        else:
            think = load.think.mean / 1e9 if load.think is not None else 0.0
            per_request = think + model.turnaround_us / 1e6 + load.output.mean * step_s
            n = (load.streams or 0) * window / max(per_request, step_s)
        into = open_loop if load.rate is not None else closed
        into[0] += n
        into[1] += n * load.output.mean
    # Streams wait for one another: at most a full batch of tokens a step.
    room = max(steps * batch - open_loop[1], 0.0)
    scale = min(1.0, room / closed[1]) if closed[1] else 1.0
    requests = open_loop[0] + closed[0] * scale
    tokens = open_loop[1] + closed[1] * scale
    memory = (
        requests * BYTES_PER_REQUEST
        + prompt_tokens * BYTES_PER_PROMPT_TOKEN
        + tokens * BYTES_PER_TOKEN
    )
    wall = steps * (WALL_PER_STEP_US + WALL_PER_SCHEDULED_US * batch) / 1e6
    return Size(int(requests), int(tokens), int(steps), int(memory), wall)


def available_memory() -> int | None:
    """MemAvailable (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(size: Size, available: int | None = None) -> None:
    """Refuse a plan that would not fit: its runs one after the other, each
    run's record kept for the table."""
    available = available_memory() if available is None else available
    if available is None:
        return
    runs = size.runs
    needed = size.memory_bytes * runs
    if needed > MEMORY_SHARE * available:
        raise OutrateError(
            f"this plan would not fit in memory: about {size.requests:,} requests and "
            f"{size.tokens:,} output tokens need about {_bytes(needed)}"
            f"{f' for {runs} runs' if runs > 1 else ''}, and {_bytes(available)} is available; "
            "shorten the duration or lower the rates (the figures of a shorter run "
            "hold for a longer one of the same shape)"
        )


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


def _duration(s: float) -> str:
    if s < 60:
        return f"{max(s, 1):.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.0f} days"
