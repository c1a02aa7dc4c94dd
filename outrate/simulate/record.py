"""What a simulated run records, and the figures made from it.

The simulator's loop (vllm_integration/offline/simulator.py) reports events here as
they happen on the virtual clock: a request arrives, tokens are sampled, a
request finishes, a step ran (its length, batch, KV use, who is held). Each
call is O(1) or O(users), so recording costs little beside the scheduler.
`Recorder.result()` turns the record into a `RunResult` (report.py): per
user and for the engine, the figures the report prints.

Token times are when the step that sampled the token ended: when the token
exists. The engine's trace stamps a step when it was scheduled, so
intervals and rates compare as they are; a time to first token includes the
step that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outrate.simulate.report import EngineStats, RunResult, Timeline, UserStats, percentile


@dataclass
class _Request:
    user: str
    arrival: int
    first: int = -1
    last: int = -1
    tokens: int = 0


@dataclass
class _User:
    times: list[int] = field(default_factory=list)  # one entry per token
    gaps: list[int] = field(default_factory=list)
    ttft: list[int] = field(default_factory=list)
    held_ns: int = 0
    live_ns: int = 0
    deferred: int = 0
    arrived: int = 0
    completed: int = 0
    prompt: list[tuple[int, int]] = field(default_factory=list)  # (step start, tokens)


class Recorder:
    def __init__(self, users: list[str], start_ns: int) -> None:
        self.start = start_ns
        self.users = {u: _User() for u in users}
        self.requests: dict[str, _Request] = {}
        self.timeline = Timeline()
        self.steps = 0
        self.busy_ns = 0
        self.tokens = 0
        self.preemptions = 0
        self.displaced = 0
        self.finished_count = 0

    def arrived(self, rid: str, user: str, t: int) -> None:
        self.requests[rid] = _Request(user, t)
        self.users[user].arrived += 1

    def sampled(self, rid: str, n: int, t: int) -> None:
        r = self.requests[rid]
        u = self.users[r.user]
        if r.first < 0:
            r.first = t
            u.ttft.append(t - r.arrival)
        else:
            u.gaps.append(t - r.last)
            u.gaps.extend([0] * (n - 1))
        r.last = t
        r.tokens += n
        u.times.extend([t] * n)
        self.tokens += n

    def finished(self, rid: str, t: int, preemptions: int) -> None:
        r = self.requests.pop(rid)
        u = self.users[r.user]
        u.completed += 1
        self.finished_count += 1
        u.live_ns += t - r.arrival
        self.preemptions += preemptions

    def deferral(self, user: str) -> None:
        self.users[user].deferred += 1

    def prompt(self, user: str, t: int, n: int) -> None:
        """`user`'s requests computed `n` prompt positions in the step
        dispatched at `t` (stamped at dispatch, as the trace's `prompt`)."""
        self.users[user].prompt.append((t, n))

    def step(
        self,
        t: int,
        dt: int,
        batch: int,
        kv: float,
        held: dict[str, int],
        queued: int,
        ran: bool,
    ) -> None:
        """One step from `t` to `t + dt`; `held`: held requests per user."""
        self.steps += 1
        if ran:
            self.busy_ns += dt
        total_held = 0
        for user, n in held.items():
            self.users[user].held_ns += n * dt
            total_held += n
        self.timeline.add(t - self.start, batch, kv, total_held, queued)

    def result(self, end_ns: int, label: str, still_preempted: int = 0) -> RunResult:
        """The figures, with requests still in flight at `end_ns` counted as
        live until then (not completed)."""
        for r in self.requests.values():
            self.users[r.user].live_ns += end_ns - r.arrival
        seconds = (end_ns - self.start) / 1e9
        users = {}
        for name, u in self.users.items():
            times = u.times
            rate = 0.0
            if len(times) >= 2 and times[-1] > times[0]:
                rate = (len(times) - 1) / ((times[-1] - times[0]) / 1e9)
            users[name] = UserStats(
                user=name,
                tokens=len(times),
                rate=rate,
                ttft_p50=percentile(u.ttft, 50),
                ttft_p99=percentile(u.ttft, 99),
                gap_p50=percentile(u.gaps, 50),
                gap_p99=percentile(u.gaps, 99),
                held_share=u.held_ns / u.live_ns if u.live_ns else 0.0,
                deferred=u.deferred,
                arrived=u.arrived,
                completed=u.completed,
                started=len(u.ttft),
                prompt_tokens=sum(k for _, k in u.prompt),
                prompt_rate=sum(k for _, k in u.prompt) / seconds if seconds > 0 else 0.0,
                prompt_steps=[(t - self.start, k) for t, k in u.prompt],
                token_times=[t - self.start for t in times],
                gaps=u.gaps,
                ttfts=u.ttft,
            )
        engine = EngineStats(
            steps=self.steps,
            seconds=seconds,
            tokens=self.tokens,
            throughput=self.tokens / seconds if seconds > 0 else 0.0,
            busy_share=self.busy_ns / (end_ns - self.start) if end_ns > self.start else 0.0,
            preemptions=self.preemptions + still_preempted,
            displaced=self.displaced,
            timeline=self.timeline,
        )
        return RunResult(label=label, users=users, engine=engine)
