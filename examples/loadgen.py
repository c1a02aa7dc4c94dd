"""Drive users against an OpenAI-compatible vLLM server and measure each user's
output-token rate, with the official `openai` client and streaming.

Used by the demo (`examples/demo.py`), the end-to-end tests and the
benchmarks, so all three measure the same way: a token's time is when its
streamed chunk reached the client; a user's rate is (tokens - 1) / (last -
first) over all of its concurrent streams.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI

MODEL = "tiny"


@dataclass
class Stream:
    user: str | None
    max_tokens: int
    started: float = 0.0
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    closed: bool = False
    _response: Any = field(default=None, repr=False)

    def close(self) -> None:
        """Disconnect now, from any thread (the server aborts the request),
        a stream still waiting for its first token included (`disconnect`)."""
        self.closed = True
        if self._response is not None:
            disconnect(self._response)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.started if self.token_times else None


def disconnect(response: Any) -> None:
    """Close a streamed response (the openai client's) from any thread, a
    read blocked on it included: its socket is shut down, which wakes that
    read (closing the response alone left it waiting for the server's next
    chunk, up to 26 s for a prompt held for its user's budget), and the
    server aborts the request."""
    network = getattr(response, "response", response).extensions.get("network_stream")
    sock = network.get_extra_info("socket") if network is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed by the other end
            sock.shutdown(socket.SHUT_RDWR)
    response.close()


def client(base_url: str, timeout: float = 120.0) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="outrate", timeout=timeout, max_retries=0)


def stream_completion(
    api: OpenAI,
    user: str | None,
    max_tokens: int,
    prompt: str = "Tell me a story about rate limits.",
    cancel_after: int | None = None,
    extra: dict[str, Any] | None = None,
    stream: Stream | None = None,
) -> Stream:
    """One streamed completion. `cancel_after=N` closes the connection after N
    tokens; another thread may call `stream.close()` to disconnect at once."""
    s = stream if stream is not None else Stream(user, max_tokens)
    body: dict[str, Any] = {"ignore_eos": True, **(extra or {})}
    if user is not None:
        body["vllm_xargs"] = {"output_rate_user": user}
    s.started = time.monotonic()
    try:
        chunks = api.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=body,
        )
        s._response = chunks
        if s.closed:  # closed while the request was sent: `close` saw no response
            disconnect(chunks)
        seen = 0
        for chunk in chunks:
            now = time.monotonic()
            if chunk.usage is not None and chunk.usage.completion_tokens > seen:
                s.token_times.extend([now] * (chunk.usage.completion_tokens - seen))
                seen = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                s.finish_reason = chunk.choices[0].finish_reason
            if s.closed or (cancel_after is not None and seen >= cancel_after):
                chunks.close()
                break
        s.completion_tokens = seen
    except Exception as exc:  # reported, not raised: callers assert on it
        if not s.closed:
            s.error = f"{type(exc).__name__}: {exc}"
    return s


def run_concurrently(
    base_url: str,
    plan: Iterable[tuple[str | None, int, int]],
    prompt: str | None = None,
    stagger_s: float = 0.0,
) -> list[Stream]:
    """plan: (user, streams, max_tokens) rows, all started at once in threads."""
    api = client(base_url)
    results: list[Stream] = []
    lock = threading.Lock()

    def one(user: str | None, max_tokens: int) -> None:
        kw = {"prompt": prompt} if prompt is not None else {}
        r = stream_completion(api, user, max_tokens, **kw)
        with lock:
            results.append(r)

    threads = []
    for user, streams, max_tokens in plan:
        for _ in range(streams):
            t = threading.Thread(target=one, args=(user, max_tokens), daemon=True)
            threads.append(t)
            t.start()
            if stagger_s:
                time.sleep(stagger_s)
    for t in threads:
        t.join()
    return results


@dataclass
class UserRate:
    user: str | None
    tokens: int
    first: float  # first token reached the client
    last: float  # last token reached the client
    sent: float  # the user's first request left the client

    @property
    def window(self) -> float:
        return self.last - self.first

    @property
    def rate(self) -> float:
        """Measured rate, first to last token."""
        return (self.tokens - 1) / self.window if self.window > 0 else float("inf")

    def bound(self, rate: float, burst_s: float) -> float:
        """The contract, (W + burst) * rate + 1, for the one window the client
        can vouch for: every token was sampled after the first request was
        sent and before the last token arrived, so W = last - sent. (First to
        last on the client is not a sound window: the first token's arrival
        carries the API server's latency, which can shrink it.)"""
        return (self.last - self.sent + burst_s) * rate + 1


def throughput(streams: Iterable[Stream], user: str | None) -> float:
    """Tokens per second from the first request's start to the last token:
    robust to tokens reaching the client in bursts."""
    mine = [s for s in streams if s.user == user]
    n = sum(len(s.token_times) for s in mine)
    end = max((s.token_times[-1] for s in mine if s.token_times), default=0.0)
    start = min((s.started for s in mine), default=0.0)
    return n / (end - start) if end > start else 0.0


def token_times(streams: Iterable[Stream], user: str | None) -> list[float]:
    """Arrival times of all of a user's tokens, over all its streams, sorted."""
    return sorted(t for s in streams if s.user == user for t in s.token_times)


def user_rate(streams: Iterable[Stream], user: str | None) -> UserRate:
    mine = [s for s in streams if s.user == user]
    times = token_times(mine, user)
    if not times:
        return UserRate(user, 0, 0.0, 0.0, 0.0)
    return UserRate(user, len(times), times[0], times[-1], min(s.started for s in mine))


def max_window_excess(times: list[float], rate: float, burst_s: float) -> float:
    """Largest (tokens in [t_i, t_j]) - bound over all windows; <= 0 means the
    GCRA bound held everywhere (on client times only a report: chunks reach
    the client in bursts, not when they were sampled)."""
    worst = float("-inf")
    times = sorted(times)
    for i in range(len(times)):
        for j in range(i, len(times)):
            w = times[j] - times[i]
            worst = max(worst, (j - i + 1) - ((w + burst_s) * rate + 1))
    return worst
