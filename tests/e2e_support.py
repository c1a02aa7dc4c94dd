"""Shared by the end-to-end modules: the policy of the one `outrate serve`
they share (started once per session in conftest.py, restarted in place by
test_e2e_quota), how a module gives it a policy of its own, and how pacing
is checked on the engine's own record."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from build_tiny_model import build
from loadgen import Stream, max_window_excess, run_concurrently, token_times, user_rate
from serverproc import ServerProcess, cpu_server_env, outrate_serve_argv, worker_env

from outrate.observe.trace import (
    engine_rate,
    largest_gap_s,
    read_trace,
    steps_allowed_rate,
    user_tokens,
)
from outrate.observe.trace import max_window_excess as engine_excess

REPO = Path(__file__).resolve().parent.parent

BURST_S = 0.1
BURST_NS = 100_000_000
# Pacing is asserted on what the engine recorded (--outrate-trace: when each
# token was dispatched), in every window. What reached the client is reported
# beside it: on two shared cores delivery can lag the engine.

POLICY = """\
version: 1
default: unlimited
anonymous: 30
burst: 100ms
users:
  acc-20-1: 20
  acc-20-4: 20
  acc-100-1: 100
  acc-100-4: 100
  slow: 20
  prompt-user: 20
  crawl: 1
  hog: 20
  edit-me: 20
  shadowy: {rate: 20, shadow: true}
  borrower: {rate: 20, peak: unlimited}
  peaky: {rate: 20, peak: 100}
  committed: 100
  roomy: 5000
"""


READ_LIMIT = 1 << 20
"""The session server's policy read limit (OUTRATE_MAX_POLICY_BYTES):
test_hostile.py's oversized policy is one byte over it."""


@contextlib.contextmanager
def session_server(root: Path):
    """The session's `outrate serve`: test_e2e, test_e2e_peak, test_e2e_truth,
    test_e2e_identity and test_hostile share it, each with its own policy
    applied through hot reload (`use_policy`), and the base POLICY back when
    the module ends. The flags are the union of what they need:
    --enable-log-requests (identity: keys must never reach the log) and
    --enable-scale-out (hostile: every route to the engine)."""
    policy_dir = root
    policy = policy_dir / "policy.yaml"
    policy.write_text(POLICY)
    model = build(REPO / "models" / "tiny-llama")
    trace = policy_dir / "trace.jsonl"
    argv = outrate_serve_argv(
        model,
        policy,
        "--max-num-seqs",
        "16",
        "--max-num-active-seqs",
        "12",
        "--outrate-trace",
        str(trace),
        "--outrate-quota-file",
        str(policy_dir / "quota.json"),
        "--enable-log-requests",
        "--enable-scale-out",
    )
    # vLLM's CPU default (the model in a worker bound to a core), where the
    # pacing judgments were measured. With the model in the engine core
    # (CPU_SERVER_ENV), 8 streams sent at once came into the batch over more
    # than 300 steps, in two fresh runs of make test (test_e2e_peak's
    # window; ~100 at most seen with the worker).
    env = cpu_server_env({"OUTRATE_MAX_POLICY_BYTES": str(READ_LIMIT), **worker_env("auto")})
    proc = ServerProcess(argv, env=env, log_path=policy_dir / "server.log", name="outrate")
    proc.policy_path = policy
    proc.trace_path = trace
    proc.quota_path = policy_dir / "quota.json"
    try:
        _start_warm(proc)
        yield proc
    finally:
        proc.stop()


def _start_warm(proc: ServerProcess) -> None:
    """Start the server and serve its first requests (the first steps of a
    new engine are its slowest: no module's timing should pay for them)."""
    proc.start(timeout_s=300)
    run_concurrently(proc.base_url, [("warmup", 2, 16)])


def restart(server: ServerProcess) -> float:
    """Stop the session's server and start it again in place: the same
    command (policy, trace and quota file), port and paths, so the modules
    after keep using the same object. The engine starts from the files as
    the stopped one left them, and under the policy the file holds now; its
    trace and counters start afresh. The log so far is kept beside, as
    `server.log.1`. Returns when (time.time()) the new server was started:
    after it, the old one had written its last."""
    server.stop()
    log = Path(server.log_path)
    log.replace(log.with_name(log.name + ".1"))
    started = time.time()
    _start_warm(server)
    return started


def use_policy(server, text: str, timeout_s: float = 30) -> None:
    """Make `text` the session server's live policy (write and rename, as an
    operator's editor does) and wait for the engine's reloader to log that
    it applied it: a step boundary has passed with the new limits. Nothing
    to wait for when the file already holds `text`."""
    path: Path = server.policy_path
    if path.is_file() and not path.is_symlink() and path.read_text() == text:
        return
    offset = Path(server.log_path).stat().st_size
    tmp = path.with_name(f".{path.name}.next")
    tmp.write_text(text)
    os.replace(tmp, path)
    wait_reloaded(server, offset, timeout_s)


def wait_reloaded(server, offset: int, timeout_s: float = 30) -> int:
    """Wait until the server's log, from byte `offset` on, says the engine
    applied its policy file; returns when it was seen (monotonic ns)."""
    applied = f"{server.policy_path}: policy reloaded: ".encode()
    deadline = time.monotonic() + timeout_s
    while True:
        with open(server.log_path, "rb") as f:
            f.seek(offset)
            if applied in f.read():
                return time.monotonic_ns()
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.policy_path} not reloaded within {timeout_s} s")
        time.sleep(0.02)


_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never an *_proxy


def wait_idle(server, timeout_s: float = 120) -> None:
    """Wait until the engine runs and queues nothing (vLLM's own gauges on
    /metrics): a module on a shared server starts with nobody else's
    request in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _LOOPBACK.open(f"{server.root_url}/metrics", timeout=10) as r:
            page = r.read().decode()
        busy = sum(
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
        )
        if busy == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the server still has {busy:.0f} requests after {timeout_s} s")
        time.sleep(0.1)


def start_together(servers: list[ServerProcess], timeout_s: float = 420) -> None:
    """Start several servers at once (their model loads overlap); raises the
    first start that failed, after every start has ended."""
    errors: list[BaseException] = []

    def start(s: ServerProcess) -> None:
        try:
            s.start(timeout_s=timeout_s)
        except BaseException as e:  # raised below, once all have ended
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _key(user: str | None) -> str:
    return "__anonymous__" if user is None else user


def trace_steps(server, since_ns: int = 0) -> list[dict]:
    """The trace's step lines from `since_ns` on. The trace is written every
    100 ms: wait until it has caught up first."""
    time.sleep(0.3)
    return [r for r in read_trace(server.trace_path) if "step" in r and r["t"] >= since_ns]


def engine_steps(server, user: str | None, since_ns: int = 0, until_ns: int | None = None):
    """(t, tokens) per step that charged `user`, from the engine's trace."""
    return user_tokens(trace_steps(server, since_ns), _key(user), since_ns, until_ns)


def step_rate(lines: list[dict], user: str | None) -> float:
    """Scheduler steps per second between `user`'s first and last charged step
    in `lines` (the trace numbers every step, whether it is written or not)."""
    mine = [r for r in lines if _key(user) in r.get("charged", {})]
    if len(mine) < 2:
        return float("inf")
    return (mine[-1]["step"] - mine[0]["step"]) / ((mine[-1]["t"] - mine[0]["t"]) / 1e9)


def step_intervals(server, user: str, since_ns: int, beside: str | None = None, margin: int = 2):
    """`user`'s steps from the engine's trace: (intervals in ms between its
    consecutive steps, how many scheduler steps between its first and last
    token did not serve it, the requests stock's loop visited in each of those
    steps). With `beside`, only the steps while `beside` had a request held
    and did nothing (no charge, hold or release) within `margin` steps: what
    held requests cost a step."""
    lines = trace_steps(server, since_ns)
    mine = [r for r in lines if user in r.get("charged", {})]
    skipped = mine[-1]["step"] - mine[0]["step"] + 1 - len(mine) if mine else 0
    held_at: dict[int, int] = {}
    busy: set[int] = set()
    held = 0
    for r in lines:
        held += r.get("held", {}).get(beside, 0) - r.get("released", {}).get(beside, 0)
        held_at[r["step"]] = held
        if (
            beside in r.get("charged", {})
            or beside in r.get("held", {})
            or beside in r.get("released", {})
        ):
            busy.update(range(r["step"] - margin, r["step"] + margin + 1))
    intervals = []
    visited = []
    for a, b in zip(mine, mine[1:], strict=False):
        if b["step"] != a["step"] + 1:
            continue
        quiet = held_at[a["step"]] > 0 and a["step"] not in busy and b["step"] not in busy
        if beside is not None and not quiet:
            continue
        intervals.append((b["t"] - a["t"]) / 1e6)
        visited.append(b["running"])
    return intervals, skipped, visited


def check_pacing(server, streams, user, limit, since_ns, report):
    """The contract, on the engine's record: the GCRA bound in every window,
    and first to last at least 0.95 x what the engine could give: what an
    exact GCRA limiter grants at the times of the steps the engine ran
    meanwhile, a token a stream a step (`steps_allowed_rate`). That is the limit
    on an engine that steps evenly and often enough; fewer on one that
    cannot (on two busy cores a 1-stream 100 tok/s user needs 100 steps/s)
    or that stalls past the burst (beside a busy loop: gaps of 166 ms with
    115 steps/s on average), which is the machine's doing, not the
    limiter's. The client's view is only reported."""
    lines = trace_steps(server, since_ns)
    steps = user_tokens(lines, _key(user))
    tokens = sum(k for _, k in steps)
    excess = engine_excess(steps, limit, BURST_NS)
    rate = engine_rate(steps)
    n_streams = sum(1 for s in streams if s.user == user)
    capacity = steps_allowed_rate(lines, steps, limit, BURST_NS, n_streams)
    ur = user_rate(streams, user)
    client_excess = max_window_excess(token_times(streams, user), limit, BURST_S)
    report.append(
        f"{user}: engine {tokens} tokens at {rate:.2f} tok/s (the engine's steps allowed "
        f"{capacity:.1f}), worst window {excess:+.2f} tokens vs the bound, largest gap "
        f"{largest_gap_s(steps) * 1000:.0f} ms; client {ur.tokens} tokens at {ur.rate:.2f} "
        f"tok/s, worst window {client_excess:+.1f}"
    )
    assert tokens == ur.tokens, report  # every token the client got was charged once
    assert excess <= 1e-6, report
    assert rate >= 0.95 * min(limit, capacity), report
    return steps


def engines_allowed(
    traces: Iterable[Path], steps: list[tuple[int, int]], rate: float, burst_ns: int, streams: int
) -> float:
    """The rate a user's `steps` (over several engines) could have had under
    one exact GCRA limit at the times those engines stepped, their traces
    merged (`steps_allowed_rate`, as `check_pacing` judges one engine): at
    most `rate`, less where the machine stalled them past the burst."""
    lines = sorted(
        (r for path in traces for r in read_trace(path) if "step" in r), key=lambda r: r["t"]
    )
    return min(rate, steps_allowed_rate(lines, steps, rate, burst_ns, streams))


def assert_complete(streams: list[Stream]) -> None:
    for s in streams:
        assert s.error is None, s.error
        assert s.completion_tokens == s.max_tokens, (s.user, s.completion_tokens)
        assert s.finish_reason == "length"
