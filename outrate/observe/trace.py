"""The engine-side token trace (`--outrate-trace PATH`): JSON lines, one per
scheduler step that charged, refunded, held or released anything.

Written for tests, the demo and operators who want to see pacing where it is
decided, not where the API server delivers it. Format (docs/trace.md):

    {"trace": "outrate", "version": 1, "pid": 1234, "clock": "monotonic_ns", ...}
    {"t": 81234567890, "step": 17, "charged": {"alice": 2}, "refunded": {"alice": 1}}
    {"t": 81244567890, "step": 18, "prompt": {"mallory": 101}}
    {"t": 81284567890, "step": 19, "held": {"alice": 2}, "over": {"bob": 1}}
    {"t": 81300000000, "policy": "<sha256>", "source": "/etc/policy.yaml"}
    {"t": 81400000000, "dropped": 120}

`t` is the scheduler's step time (CLOCK_MONOTONIC, ns): every token charged in
the step was dispatched at `t`. Per user id: `charged` tokens (shadow
over-limit tokens included), `refunded` (charged but not scheduled: net is
charged - refunded), `held` and `released` requests, `over` (tokens a shadow
limit would have refused), `prompt` (prompt tokens computed and charged to a
prompt limit, net of refunds), `prompt_over` (of those, the ones over a shadow
prompt limit), `prompt_waiting` (requests that found no prompt budget for
their next prompt position), `prompt_borrowed` (of the prompt tokens, the ones
past the prompt rate, borrowed under its `peak` in spare step time). Where a
rule has a `peak` (the step model runs), `predicted_us`: the step's length as
the model predicted it at dispatch (the time to the next step's `t` is its
real length), and `per_seq_us`: what the model priced one more request at,
the cost lending divided the spare time by. Keys with nothing to say are
left out.

The scheduler only appends a tuple to a bounded deque; a daemon thread formats
and writes, and stops writing at `max_bytes` (a last line says so). If the
writer falls behind by more than `max_pending` steps, the oldest steps are
dropped and a `dropped` line counts them: the scheduler never waits on disk.

Where a trace may be written, and how the engine core opens it, is
tracefile.py's.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any

from outrate.budget.gcra import Limit, gcra
from outrate.env import MAX_TRACE_BYTES
from outrate.errors import Problem
from outrate.fileread import MIB, FileLimit, FileReadError, read_lines
from outrate.observe.tracefile import open_trace_file

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
MAX_TRACE_LINE_BYTES = MIB
FLUSH_INTERVAL_S = 0.1
MAX_PENDING = 200_000

Counts = dict[str, int]
_C = Counts
Step = tuple[int, int, int, _C, _C, _C, _C, _C, _C, _C, _C, _C, _C, _C, _C, int, int]
"""(t, step, running, charged, refunded, held, released, over, borrowed, first,
arrived, prompt, prompt_over, prompt_waiting, prompt_borrowed, predicted_us,
per_seq_us)."""

_KEYS = (
    "charged",
    "refunded",
    "held",
    "released",
    "over",
    "borrowed",
    "first",
    "arrived",
    "prompt",
    "prompt_over",
    "prompt_waiting",
    "prompt_borrowed",
)


class TraceWriter:
    def __init__(
        self,
        path: str,
        header: dict[str, Any] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_pending: int = MAX_PENDING,
        logger: logging.Logger | None = None,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._pending: collections.deque[Step | dict[str, Any]] = collections.deque(
            maxlen=max_pending
        )
        self._max_pending = max_pending
        self._dropped = 0
        self.dropped_total = 0
        """Steps dropped since start, as the `dropped` lines add up (counted
        when the writer catches up): `outrate_trace_dropped_steps_total`."""
        self._written = 0
        self._full = False
        self._logger = logger or logging.getLogger("vllm.outrate")
        self._stop = threading.Event()
        self._file = open_trace_file(path)  # closed in stop()
        self._thread = threading.Thread(target=self._run, name="outrate-trace", daemon=True)
        first = {
            "trace": "outrate",
            "version": 1,
            "pid": os.getpid(),
            "clock": "monotonic_ns",
            "t": time.monotonic_ns(),
            **(header or {}),
        }
        self._write_line(json.dumps(first, separators=(",", ":")))
        try:
            self._file.flush()
        except OSError as e:  # a full disk at startup: like one later, the engine serves on
            self._give_up(f"cannot write the trace: {e}")

    def start(self) -> None:
        self._thread.start()

    # -- called by the scheduler thread: O(1), no I/O ---------------------------

    def step(self, entry: Step) -> None:
        if len(self._pending) == self._max_pending:
            self._dropped += 1  # the deque drops its oldest entry
        self._pending.append(entry)

    def event(self, t: int, **fields: Any) -> None:
        """A line that is not a step (policy swaps)."""
        if len(self._pending) == self._max_pending:
            self._dropped += 1
        self._pending.append({"t": t, **fields})

    # -- the writer thread --------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._drain()
        try:
            self._file.close()
        except OSError as e:  # the last flush; said at most once, like every failed write
            self._give_up(f"cannot write the trace: {e}")

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self._drain()

    def _drain(self) -> None:
        if self._file.closed:
            return
        pending = self._pending
        lines = []
        dropped, self._dropped = self._dropped, 0
        if dropped:
            self.dropped_total += dropped
            lines.append(json.dumps({"t": time.monotonic_ns(), "dropped": dropped}))
        while pending:
            try:
                entry = pending.popleft()
            except IndexError:
                break
            lines.append(_format(entry))
        if not lines:
            return
        for line in lines:
            if not self._write_line(line):
                break
        try:
            self._file.flush()
        except OSError as e:
            self._give_up(f"cannot write the trace: {e}")

    def _write_line(self, line: str) -> bool:
        if self._full:
            return False
        size = len(line) + 1
        if self._written + size > self.max_bytes:
            note = json.dumps({"t": time.monotonic_ns(), "truncated": self.max_bytes})
            self._file.write(note + "\n")
            self._give_up(f"trace reached its cap of {self.max_bytes} bytes; no more lines")
            return False
        try:
            self._file.write(line + "\n")
        except OSError as e:
            self._give_up(f"cannot write the trace: {e}")
            return False
        self._written += size
        return True

    def _give_up(self, why: str) -> None:
        if not self._full:
            self._logger.warning("outrate: %s: %s", self.path, why)
        self._full = True


def _format(entry: Step | dict[str, Any]) -> str:
    if isinstance(entry, dict):
        return json.dumps(entry, separators=(",", ":"))
    t, step, running, *maps, predicted, per_seq = entry
    out: dict[str, Any] = {"t": t, "step": step, "running": running}
    for key, value in zip(_KEYS, maps, strict=True):
        if value:
            out[key] = value
    if predicted:  # the model ran: its slope too, 0 included (free work)
        out["predicted_us"] = predicted
        out["per_seq_us"] = per_seq
    return json.dumps(out, separators=(",", ":"))


# -- reading a trace (tests, the demo, tools) ------------------------------------


TRACE_FILE = FileLimit("a trace", 2 * DEFAULT_MAX_BYTES, MAX_TRACE_BYTES, line=MAX_TRACE_LINE_BYTES)
"""Traces read back: twice what the writer writes by default (the cap is a
flag), each line at most a MiB (a step line with thousands of users is tens
of KiB)."""


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every line of a trace as a dict (a line that is not JSON, a torn last
    one, is skipped). Read like every file outrate is handed
    (`outrate.fileread`): a regular file, never blocking, bounded in size
    and in line length. A line that is JSON but not a trace line (not an
    object, a count that is not a whole number, nested too deep) is an
    OutrateError located at it: the fit would fail on it later, with a
    traceback."""
    source = os.fspath(path)
    out: list[dict[str, Any]] = []
    for number, line in read_lines(source, TRACE_FILE):
        why: str | None
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        except RecursionError:  # json.loads recurses once per level of nesting
            why = "nested too deep"
        else:
            why = _not_a_trace_line(rec)
        if why is not None:
            problem = Problem(source, number, 1, "<line>", f"not a trace line: {why}")
            raise FileReadError(problem) from None
        out.append(rec)
    return out


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _not_a_trace_line(rec: Any) -> str | None:
    """What makes a JSON value no trace line, or None (unknown keys pass:
    newer writers may add some)."""
    if not isinstance(rec, dict):
        return f"expected a JSON object (got {type(rec).__name__})"
    for key in ("t", "step", "running", "predicted_us", "per_seq_us", "dropped", "truncated"):
        if key in rec and not _whole(rec[key]):
            return f"{key}: expected a whole number"
    for key in _KEYS:
        counts = rec.get(key, {})
        if not isinstance(counts, dict) or not all(_whole(k) for k in counts.values()):
            return f"{key}: expected an object of whole numbers"
    return None


def user_tokens(
    lines: list[dict[str, Any]], user: str, since_ns: int = 0, until_ns: int | None = None
) -> list[tuple[int, int]]:
    """(t, net tokens) of one user per step that charged it, in time order,
    for steps in [since_ns, until_ns]."""
    out = []
    for rec in lines:
        t = rec.get("t", 0)
        if t < since_ns or (until_ns is not None and t > until_ns):
            continue
        n = rec.get("charged", {}).get(user, 0) - rec.get("refunded", {}).get(user, 0)
        if n:
            out.append((t, n))
    return out


def engine_rate(steps: list[tuple[int, int]]) -> float:
    """(tokens - 1) / (last - first): the paced rate, first token to last."""
    if len(steps) < 2:
        return 0.0
    tokens = sum(k for _, k in steps)
    return (tokens - 1) / ((steps[-1][0] - steps[0][0]) / 1e9)


def max_tokens_in(steps: list[tuple[int, int]], window_ns: int) -> int:
    """Most tokens in any window of `window_ns` (the demo's worst 1-second window)."""
    best = total = 0
    j = 0
    for t, k in steps:
        total += k
        while steps[j][0] <= t - window_ns:
            total -= steps[j][1]
            j += 1
        best = max(best, total)
    return best


def max_window_excess(steps: list[tuple[int, int]], rate: float, burst_ns: int) -> float:
    """Largest `tokens in [t_i, t_j] - ((t_j - t_i + burst) * rate + 1)` over all
    windows that start and end on a charged step (the worst windows do): <= 0
    means the GCRA bound held in every window.

    Exact in O(n): with P the prefix sums, the excess of (i, j) is
    `(P[j+1] - r t_j) - (P[i] - r t_i) - r burst - 1`, so for each i it is
    maximised by the largest `P[j+1] - r t_j` over j >= i (a suffix maximum).
    """
    if not steps:
        return float("-inf")
    r = rate / 1e9  # tokens per ns
    prefix = [0]
    for _, k in steps:
        prefix.append(prefix[-1] + k)
    worst = float("-inf")
    best_end = float("-inf")
    for i in range(len(steps) - 1, -1, -1):
        t = steps[i][0]
        best_end = max(best_end, prefix[i + 1] - r * t)
        worst = max(worst, best_end - (prefix[i] - r * t))
    return worst - r * burst_ns - 1


def largest_gap_s(steps: list[tuple[int, int]]) -> float:
    """Longest time between two consecutive charged steps of one user."""
    return max(((b[0] - a[0]) / 1e9 for a, b in zip(steps, steps[1:], strict=False)), default=0.0)


def gcra_allowed(
    times_ns: list[int], limit: float, burst_ns: int, per_step: int, drained: bool = False
) -> int:
    """Tokens a GCRA limit (`limit` tok/s, `burst_ns`: `limit x burst + 1` at
    once) grants at these step times to a user that always wants more, at
    most `per_step` a step (a token a stream), its bucket full at the first,
    or `drained` (it has just taken all it may, as a user running at its
    limit has: for a window in the middle of a run): what the limiter's own
    `gcra()` gives on those steps, stalls included (a stall longer than the
    burst loses the tokens past it, under any limiter)."""
    lim = Limit(limit, burst_ns)
    n = 0
    tat = times_ns[0] * lim.scale + lim.tolerance + lim.interval if drained and times_ns else 0
    for t in times_ns:
        k, tat = gcra(tat, t * lim.scale, lim.interval, lim.tolerance, per_step)
        n += k
    return n


def steps_allowed_rate(
    lines: list[dict[str, Any]],
    steps: list[tuple[int, int]],
    limit: float,
    burst_ns: int,
    per_step: int,
) -> float:
    """What the engine could give a user, in the `engine_rate` of its `steps`:
    `gcra_allowed` at the times of every step the engine traced (`lines`)
    from the user's first charged step to its last, `per_step` tokens a step
    at most. The limit on an engine that steps evenly and often enough; less
    on one that cannot (a 1-stream 100 tok/s user needs 100 steps/s) or that
    stalls past the burst: the machine's doing, not the limiter's. The limit
    itself with fewer than two steps."""
    if len(steps) < 2:
        return float(limit)
    first, last = steps[0][0], steps[-1][0]
    times = [r["t"] for r in lines if "step" in r and first <= r["t"] <= last]
    return (gcra_allowed(times, limit, burst_ns, per_step) - 1) / ((last - first) / 1e9)
