"""Prompt limits on a real `outrate serve` (issue 40's prompt flood), judged
from the engine's own trace (`prompt`: computed prompt tokens charged per
user per step; `arrived`/`first`: a request reaching the engine and its
first token).

The flood: a user far inside its output rate (`max_tokens: 1`) that keeps 8
streams of ~1,800-token prompts going, each prompt different (no prefix-cache
hits). bob {rate: 100} meanwhile runs one long stream (its decode) and short
requests one after another (its time to first token).

- with `mallory {rate: 20, prompt: 500}`: bob's decode tok/s is at least 0.9x
  alone, his engine time to first token p50 at most 2x alone plus one step,
  and mallory's computed prompt tokens obey the GCRA bound at 500 tok/s in
  every window (+1 token per window, as for output);
- with `flooder {rate: 20}` (prompts unlimited, as before issue 40) the same
  run is printed beside it: what the prompt limit saves bob;
- /metrics during mallory's flood, as `outrate top` reads it: her prompt
  tok/s (the engine's counter agrees with its trace over the same window),
  her prompt limit, her requests waiting for prompt budget (the trace's
  `prompt_waiting` too); bob, without a prompt limit, never waits for one;
- work conserved: pete `{rate: 20, prompt: {rate: 500, peak: unlimited}}`
  flooding alone computes at least 0.9x the prompt tokens per second of the
  unlimited flooder alone (runs in the order flooder, pete, pete, flooder,
  so that a machine drifting over the test moves both alike); all but his
  500 tok/s is borrowed (the trace's `prompt_borrowed`), and the rest keeps
  the prompt rate's bound.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

pytest.importorskip("vllm")

from e2e_support import (  # noqa: E402
    BURST_NS,
    POLICY,
    engine_steps,
    trace_steps,
    use_policy,
    wait_idle,
)
from loadgen import Stream, client, stream_completion  # noqa: E402
from serverproc import replayed  # noqa: E402

from outrate.observe.scrape import Snapshot, metrics_url, rows, scrape  # noqa: E402
from outrate.observe.trace import engine_rate, max_window_excess  # noqa: E402

PROMPT_RATE = 500
FLOOD = POLICY + (
    f"  mallory: {{rate: 20, prompt: {PROMPT_RATE}}}\n  flooder: 20\n  bob: 100\n"
    f"  pete: {{rate: 20, prompt: {{rate: {PROMPT_RATE}, peak: unlimited}}}}\n"
)
ALONE_S = 3.0
"""Each alone flood is judged over this long, once it is in the engine."""
STREAMS = 8


@pytest.fixture(scope="module")
def server(server):
    """The session's server with the flood's users; the base policy back at
    the end."""
    wait_idle(server)
    use_policy(server, FLOOD)
    yield server
    wait_idle(server)
    use_policy(server, POLICY)


_NEXT = itertools.count()


def _prompt() -> str:
    # A different first token in each: no block of it is a prefix-cache hit.
    return f"{next(_NEXT)} " + "rate limits keep engines fair. " * 105  # about 1,790 tokens


class Flood:
    """`user`'s 8 streams, each sending the next long prompt as soon as the
    last one's single token came back."""

    def __init__(self, server, user: str) -> None:
        self.api = client(server.base_url)
        self.user = user
        self.stop = threading.Event()
        self.sent = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(STREAMS)]
        self.current: list[Stream | None] = [None] * STREAMS

    def _run(self, k: int) -> None:
        while not self.stop.is_set():
            s = self.current[k] = Stream(self.user, 1)
            stream_completion(self.api, self.user, 1, prompt=_prompt(), stream=s)
            if s.error and not s.closed:
                self.errors.append(s.error)
            self.sent += 1

    def __enter__(self) -> Flood:
        for t in self.threads:
            t.start()
        time.sleep(2.0)  # the flood is in the engine
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for s in self.current:  # what is still queued is aborted, not waited for
            if s is not None:
                s.close()
        for t in self.threads:
            t.join(timeout=120)


def _bob(server, tokens: int = 300, firsts: int = 6) -> tuple[float, list[float], float]:
    """bob's decode (engine tok/s of one stream of `tokens` past its first 20
    tokens), his engine time to first token of `firsts` short requests one
    after another (arrival to first token, from the trace), and the mean step
    length meanwhile (ms)."""
    api = client(server.base_url)
    since = time.monotonic_ns()
    long_run = stream_completion(api, "bob", tokens)
    assert long_run.error is None, long_run.error
    decode = engine_steps(server, "bob", since)
    seen = 0
    for i, (_, k) in enumerate(decode):
        seen += k
        if seen >= 20:
            decode = decode[i:]
            break
    rate = engine_rate(decode)
    since = time.monotonic_ns()
    for _ in range(firsts):
        s = stream_completion(api, "bob", 2)  # its first token is what is judged
        assert s.error is None, s.error
    lines = trace_steps(server, since)
    arrived = [r["t"] for r in lines for _ in range(r.get("arrived", {}).get("bob", 0))]
    first = [r["t"] for r in lines for _ in range(r.get("first", {}).get("bob", 0))]
    assert len(arrived) == len(first) == firsts, (arrived, first)
    ttft = [(f - a) / 1e6 for a, f in zip(arrived, first, strict=True)]
    steps = [r for r in lines if "step" in r]
    step_ms = (steps[-1]["t"] - steps[0]["t"]) / 1e6 / max(1, steps[-1]["step"] - steps[0]["step"])
    return rate, ttft, step_ms


def _beside(server, user: str, url: str) -> tuple[tuple, tuple[Snapshot, Snapshot]]:
    """bob (`_bob`) inside `user`'s flood, with when it began and how many
    prompts she sent; and /metrics scraped as bob began and ended."""
    since = time.monotonic_ns()
    with Flood(server, user) as flood:
        first = scrape(url, 5)
        # Beside the unlimited flood bob decodes at a few tok/s and waits
        # seconds for a first token: a shorter stream and two first tokens,
        # printed, not judged (60 tokens and six took 25-45 s of the suite).
        run = _bob(server, 300) if user == "mallory" else _bob(server, 30, 2)
        page = (first, scrape(url, 5))
    assert not flood.errors, flood.errors[:3]
    return (*run, since, flood.sent), page


def test_a_prompt_limit_keeps_a_prompt_flood_off_others(server):
    url = metrics_url(server.root_url)
    alone_rate, alone_ttft, alone_step = _bob(server)
    runs, pages = {}, {}
    for user in ("flooder", "mallory"):
        runs[user], pages[user] = _beside(server, user, url)
    if runs["mallory"][0] < 0.9 * alone_rate:
        # Beside a one-core busy loop (issue 39, item 5) the machine once
        # slowed between bob alone and bob beside her flood: 61.7 tok/s
        # against 102.6, with the steps around his short requests as short
        # as alone. Both played once more (printed), and judged on the
        # second; a flood that takes his time slows him both times.
        replayed(
            f"bob beside mallory's flood: {runs['mallory'][0]:.1f} tok/s against "
            f"{alone_rate:.1f} alone: both"
        )
        alone_rate, alone_ttft, alone_step = _bob(server)
        runs["mallory"], pages["mallory"] = _beside(server, "mallory", url)
    p50_alone = statistics.median(alone_ttft)
    print(
        f"bob alone: decode {alone_rate:.1f} tok/s, engine TTFT p50 {p50_alone:.1f} ms, "
        f"step {alone_step:.1f} ms"
    )
    for user, (rate, ttft, step_ms, _, sent) in runs.items():
        print(
            f"beside {user}'s flood ({sent} prompts): decode {rate:.1f} tok/s "
            f"({rate / alone_rate:.2f}x alone), engine TTFT p50 "
            f"{statistics.median(ttft):.1f} ms, mean step {step_ms:.1f} ms"
        )
    rate, ttft, step_ms, since, _ = runs["mallory"]
    lines = trace_steps(server, since)
    prompt = [(r["t"], r["prompt"]["mallory"]) for r in lines if "mallory" in r.get("prompt", {})]
    computed = sum(k for _, k in prompt)
    excess = max_window_excess(prompt, PROMPT_RATE, BURST_NS)
    print(
        f"mallory: {computed} prompt tokens computed at {engine_rate(prompt):.0f} tok/s; "
        f"worst window against {PROMPT_RATE} tok/s {excess:+.2f}"
    )
    assert computed > PROMPT_RATE  # she did flood
    assert excess <= 1 + 1e-6  # (W + burst) * rate + 1 in every window
    assert rate >= 0.9 * alone_rate
    assert statistics.median(ttft) <= 2 * p50_alone + step_ms
    _check_metrics(pages, lines)


def _check_metrics(pages: dict[str, tuple[Snapshot, Snapshot]], lines: list[dict]) -> None:
    """What /metrics said during mallory's flood (two scrapes, as `outrate
    top` takes them) against the engine's trace over the same window. The
    counter reaches /metrics up to 0.5 s late at each end (the publisher's
    interval), so the two agree within 1 s of her prompt rate plus a burst."""
    first, second = pages["mallory"]
    mine = {r.limit: r for r in rows(first, second)}
    mal, bob = mine["mallory"], mine["bob"]
    t0, t1 = round(first.at * 1e9), round(second.at * 1e9)
    traced = sum(
        r["prompt"].get("mallory", 0) for r in lines if t0 <= r["t"] <= t1 and "prompt" in r
    )
    counted = (second.limits["mallory"].prompt_tokens or 0) - (
        first.limits["mallory"].prompt_tokens or 0
    )
    waiting = (first.limits["mallory"].prompt_waiting, second.limits["mallory"].prompt_waiting)
    waited = sum(r.get("prompt_waiting", {}).get("mallory", 0) for r in lines)
    flooder = {r.limit: r for r in rows(*pages["flooder"])}["flooder"]
    print(
        f"/metrics over {second.at - first.at:.1f} s of mallory's flood: prompt "
        f"{mal.prompt:.0f} tok/s (limit {mal.prompt_limit:.0f}), {counted:.0f} tokens counted, "
        f"{traced} in the trace; requests waiting for prompt budget {waiting[0]:.0f} and "
        f"{waiting[1]:.0f}, {waited} request-steps waiting in the trace; flooder's prompts "
        f"{flooder.prompt:.0f} tok/s (limit {flooder.prompt_limit})"
    )
    assert mal.prompt_limit == PROMPT_RATE and flooder.prompt_limit == float("inf")
    assert abs(counted - traced) <= PROMPT_RATE * 1.0 + PROMPT_RATE * BURST_NS / 1e9 + 1
    assert max(w or 0 for w in waiting) >= 1 and waited > 0
    assert bob.prompt_waiting == 0
    assert not any("bob" in r.get("prompt_waiting", {}) for r in lines)


def test_a_prompt_peak_alone_computes_as_much_as_an_unlimited_user(server):
    got: dict[str, list[tuple[int, int, int]]] = {"flooder": [], "pete": []}
    seconds = dict.fromkeys(got, 0.0)
    for user in ("flooder", "pete", "pete", "flooder"):
        wait_idle(server)
        with Flood(server, user) as flood:
            since = time.monotonic_ns()
            time.sleep(ALONE_S)
            until = time.monotonic_ns()
        assert not flood.errors, flood.errors[:3]
        seconds[user] += (until - since) / 1e9
        got[user] += [
            (r["t"], r["prompt"][user], r.get("prompt_borrowed", {}).get(user, 0))
            for r in trace_steps(server, since)
            if r["t"] <= until and user in r.get("prompt", {})
        ]
    rate = {u: sum(n for _, n, _ in steps) / seconds[u] for u, steps in got.items()}
    lent = sum(b for _, _, b in got["pete"])
    computed = sum(n for _, n, _ in got["pete"])
    committed = [(t, n - b) for t, n, b in got["pete"]]
    ratio = rate["pete"] / rate["flooder"]
    print(
        f"alone: the unlimited flooder {rate['flooder']:.0f} prompt tok/s, pete (prompt "
        f"{PROMPT_RATE}, peak unlimited) {rate['pete']:.0f} ({ratio:.2f}x), "
        f"{lent} of his {computed} prompt tokens borrowed"
    )
    assert rate["flooder"] > 2 * PROMPT_RATE  # a flood well past the prompt rate
    assert rate["pete"] >= 0.9 * rate["flooder"]
    assert lent >= computed - PROMPT_RATE * (seconds["pete"] + 2 * BURST_NS / 1e9) - 2
    assert max_window_excess(committed, PROMPT_RATE, BURST_NS) <= 1 + 1e-6
