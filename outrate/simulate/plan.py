"""From a workload to requests, drawn the same way wherever they are sent.

The simulator (vllm_integration/offline/simulator.py) and the player that sends the
same workload to a real server (examples/workload_player.py) both draw from
here, so one file and one seed give the same prompts, lengths, think times
and arrivals on both sides; only what the engine does with them differs.

Every closed-loop stream and every open-loop user has its own generator,
seeded by (seed, user, stream): adding a user does not change anyone else's
draws, and the order in which streams finish does not either.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from outrate.simulate.workload import UserLoad, Workload

FIRST_TOKEN_ID = 6
"""Prompt token ids are FIRST_TOKEN_ID .. FIRST_TOKEN_ID + 255: above the
special tokens of the tiny test model, inside any real vocabulary."""


@dataclass(frozen=True)
class RequestSpec:
    """One request as it leaves the user."""

    id: str
    user: str
    prompt: list[int]
    output: int
    priority: int = 0


def _prompt(rng: random.Random, n: int, prefix: list[int]) -> list[int]:
    """`n` token ids: the user's shared prefix, then random ids (random
    blocks: no prefix-cache hit between requests beyond the shared prefix)."""
    head = prefix[: max(min(len(prefix), n - 1), 0)]
    return head + [FIRST_TOKEN_ID + b for b in rng.randbytes(n - len(head))]


class _Source:
    def __init__(self, user: str, ul: UserLoad, key: str, seed: int) -> None:
        self.user = user
        self.load = ul
        self.rng = random.Random(f"{seed}/{user}/{key}")
        self.prefix = (
            [
                FIRST_TOKEN_ID + b
                for b in random.Random(f"{seed}/{user}/prefix").randbytes(ul.prefix)
            ]
            if ul.prefix
            else []
        )
        self.key = key
        self.n = 0

    def next_request(self) -> RequestSpec:
        ul = self.load
        self.n += 1
        prompt = _prompt(self.rng, ul.prompt.sample(self.rng), self.prefix)
        output = ul.output.sample(self.rng)
        return RequestSpec(
            f"{self.user}/{self.key}/{self.n}", self.user, prompt, output, ul.priority
        )


class Stream(_Source):
    """A closed-loop stream: asks, waits for the whole answer, thinks, asks again,
    from `first_ns` until `stop_ns` (no request starts at or after it)."""

    def __init__(self, user: str, index: int, load: UserLoad, seed: int, duration_ns: int) -> None:
        super().__init__(user, load, f"s{index}", seed)
        ramp = load.ramp or 0
        streams = load.streams or 1
        self.first_ns = load.start + ramp * index // streams
        self.stop_ns = min(load.stop if load.stop is not None else duration_ns, duration_ns)

    def think_ns(self) -> int:
        return self.load.think.sample(self.rng) if self.load.think is not None else 0


class OpenUser(_Source):
    """An open-loop user: requests arrive at their times whatever the engine does."""

    def __init__(self, user: str, load: UserLoad, seed: int, duration_ns: int) -> None:
        super().__init__(user, load, "open", seed)
        self.stop_ns = min(load.stop if load.stop is not None else duration_ns, duration_ns)
        self.arrivals_rng = random.Random(f"{seed}/{user}/arrivals")

    def arrivals(self) -> list[tuple[int, RequestSpec]]:
        """(time in ns from the run's start, request), in time order."""
        assert self.load.rate is not None
        gap = 1e9 / self.load.rate
        poisson = self.load.arrival != "even"
        out: list[tuple[int, RequestSpec]] = []
        t = float(self.load.start)
        while True:
            t += self.arrivals_rng.expovariate(1.0 / gap) if poisson else gap
            if t >= self.stop_ns:
                return out
            out.append((int(t), self.next_request()))


@dataclass
class Plan:
    """What a workload sends: its closed-loop streams and its open-loop arrivals."""

    streams: list[Stream]
    arrivals: list[tuple[int, RequestSpec]]
    users: list[str]
    duration_ns: int


def plan(workload: Workload) -> Plan:
    streams: list[Stream] = []
    arrivals: list[tuple[int, RequestSpec]] = []
    users = []
    for user, load in workload.expanded():
        users.append(user)
        if load.streams is not None:
            streams += [
                Stream(user, i, load, workload.seed, workload.duration) for i in range(load.streams)
            ]
        else:
            arrivals += OpenUser(user, load, workload.seed, workload.duration).arrivals()
    arrivals.sort(key=lambda a: a[0])
    return Plan(streams, arrivals, users, workload.duration)
