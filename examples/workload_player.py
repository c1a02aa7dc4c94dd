"""Send a workload file (`outrate simulate`'s) to a real OpenAI-compatible
vLLM server, with the same requests the simulator draws.

The draws come from `outrate.simulate.plan`: the same prompts (token ids),
output lengths, think times and arrivals for one file and seed. Each
closed-loop stream is a thread (ask, read the whole answer, think, ask
again, until its stop time); open-loop requests start at their arrival
times. At the workload's end every request still streaming is closed (the
server aborts it), as the simulator stops at its end.

Per request it records what the client saw (sent, first token, last token)
and, with `--enable-per-request-metrics` on the server, what the engine
measured: queue time plus time to first token, from the request entering the
engine's queue to its first token leaving the engine core (vLLM's
`RequestStateStats`, engine-core timestamps): the simulator's time to first
token, measured on the engine.

    python examples/workload_player.py http://127.0.0.1:8000/v1 load.yaml
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from loadgen import MODEL, client, disconnect

from outrate.simulate.plan import RequestSpec, plan
from outrate.simulate.workload import Workload, load_workload


@dataclass
class Played:
    id: str
    user: str
    output: int
    sent: float  # time.monotonic() when the request left
    first: float | None = None  # first token reached the client
    last: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    engine_ttft_s: float | None = None  # queue + first token, engine-side
    error: str | None = None
    closed: bool = False
    _response: Any = field(default=None, repr=False)

    @property
    def client_ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.sent


class Player:
    def __init__(self, base_url: str, workload: Workload, timeout_s: float = 300) -> None:
        self.api = client(base_url, timeout=timeout_s)
        self.workload = workload
        self.plan = plan(workload)
        self.played: list[Played] = []
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self.start = 0.0

    def _send(self, spec: RequestSpec) -> Played:
        p = Played(spec.id, spec.user, spec.output, time.monotonic())
        with self._lock:
            self.played.append(p)
            self._open.add(id(p))
        body: dict[str, Any] = {"ignore_eos": True, "vllm_xargs": {"output_rate_user": spec.user}}
        if spec.priority:
            body["priority"] = spec.priority
        try:
            chunks = self.api.completions.create(
                model=MODEL,
                prompt=spec.prompt,
                max_tokens=spec.output,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                extra_body=body,
            )
            p._response = chunks
            if p.closed:  # cut while it was sent: `play` saw no response
                disconnect(chunks)
            for chunk in chunks:
                now = time.monotonic()
                usage = chunk.usage
                if usage is not None and usage.completion_tokens > p.tokens:
                    p.first = now if p.first is None else p.first
                    p.last = now
                    p.tokens = usage.completion_tokens
                if chunk.choices and chunk.choices[0].finish_reason:
                    p.finish_reason = chunk.choices[0].finish_reason
                metrics = (chunk.model_extra or {}).get("metrics")
                if metrics:
                    queue = metrics.get("queue_time_ms")
                    ttft = metrics.get("time_to_first_token_ms")
                    if queue is not None and ttft is not None:
                        p.engine_ttft_s = (queue + ttft) / 1000
        except Exception as exc:  # reported, not raised: the caller checks
            if not p.closed:
                p.error = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._open.discard(id(p))
        return p

    def _sleep_until(self, t_ns: int) -> bool:
        """Sleep until `t_ns` after the start; False if the workload is over."""
        delay = self.start + t_ns / 1e9 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return time.monotonic() < self.start + self.plan.duration_ns / 1e9

    def _stream(self, s: Any) -> None:
        t = s.first_ns
        while t < s.stop_ns and self._sleep_until(t):
            self._send(s.next_request())
            think = s.think_ns()
            t = int((time.monotonic() - self.start) * 1e9) + think

    def _open_loop(self) -> None:
        threads = []
        for t, spec in self.plan.arrivals:
            if not self._sleep_until(t):
                break
            th = threading.Thread(target=self._send, args=(spec,), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()

    def play(self) -> list[Played]:
        """Run the whole workload now; returns every request sent."""
        self.start = time.monotonic()
        threads = [
            threading.Thread(target=self._stream, args=(s,), daemon=True) for s in self.plan.streams
        ]
        threads.append(threading.Thread(target=self._open_loop, daemon=True))
        for th in threads:
            th.start()
        end = self.start + self.plan.duration_ns / 1e9
        time.sleep(max(end - time.monotonic(), 0))
        with self._lock:  # the workload is over: cut what still streams
            cut = [p for p in self.played if id(p) in self._open]
        for p in cut:  # a request still waiting for its first token too
            p.closed = True
            if p._response is not None:
                disconnect(p._response)
        for th in threads:
            th.join(timeout=30)
        return list(self.played)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base_url", help="the server's OpenAI base URL, http://host:port/v1")
    ap.add_argument("workload", help="a workload file")
    args = ap.parse_args()
    played = Player(args.base_url, load_workload(args.workload).workload).play()
    for p in played:
        row = {k: v for k, v in asdict(p).items() if not k.startswith("_")}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
