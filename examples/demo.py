"""`make demo`: outrate enforcing a policy on a real vLLM engine, start to finish.

1. builds (or reuses) the tiny local Llama in models/tiny-llama;
2. starts `outrate serve` on 127.0.0.1 with policies/demo.yaml and the engine's
   token trace (`--outrate-trace`) on;
3. drives four users at once through the official `openai` client, streaming:
   user-a (4 streams, limit 20 tok/s), user-b (1 stream, 100 tok/s),
   user-c (unlimited) and anonymous requests (2 streams sharing 50 tok/s);
4. prints a per-user table and writes out/demo.png (cumulative output tokens
   per user): pacing is judged on the engine's trace, when each token was
   sampled; what reached the client is drawn and printed beside it, not judged;
5. stops the server. Exits 1 if any user got more than its bound allows, a
   request did not complete, or the engine stalled a user it was not throttling.

Every number it prints is measured in this run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_tiny_model import build  # noqa: E402
from loadgen import Stream, run_concurrently, token_times, user_rate  # noqa: E402
from serverproc import ServerProcess, outrate_serve_argv  # noqa: E402

from outrate.identity.core import ANONYMOUS  # noqa: E402
from outrate.observe.trace import (  # noqa: E402
    engine_rate,
    largest_gap_s,
    max_tokens_in,
    max_window_excess,
    read_trace,
    user_tokens,
)

POLICY = REPO / "policies" / "demo.yaml"
BURST_NS = 100_000_000  # policies/demo.yaml: burst: 100ms
TOLERANCE = 1e-6  # tokens: float rounding in the window check, nothing more
STALL_S = 1.0  # an engine-side gap longer than this (plus 1/limit) is a stall

# (label, user id sent, streams, max_tokens per stream, limit in tok/s or None)
USERS: list[tuple[str, str | None, int, int, float | None]] = [
    ("user-a", "user-a", 4, 35, 20),
    ("user-b", "user-b", 1, 700, 100),
    ("user-c", "user-c", 1, 1500, None),
    ("anonymous", None, 2, 175, 50),
]


@dataclass
class Measured:
    """One user's run: the engine's record (`steps`) and the client's."""

    label: str
    user: str | None
    limit: float | None
    streams: list[Stream]
    max_tokens: int
    steps: list[tuple[int, int]]  # (t in monotonic ns, tokens) per scheduler step

    @property
    def engine_tokens(self) -> int:
        return sum(k for _, k in self.steps)

    @property
    def client_tokens(self) -> int:
        return sum(len(s.token_times) for s in self.streams)

    @property
    def errors(self) -> list[str]:
        return [s.error for s in self.streams if s.error is not None]

    @property
    def complete(self) -> bool:
        return not self.errors and all(s.completion_tokens == self.max_tokens for s in self.streams)

    @property
    def excess(self) -> float | None:
        """Worst window vs the GCRA bound on the engine's record (None: unlimited)."""
        if self.limit is None:
            return None
        return max_window_excess(self.steps, self.limit, BURST_NS)

    @property
    def allowed_gap_s(self) -> float:
        """A throttled user waits about 1/limit between tokens; anything beyond
        STALL_S on top of that is the engine not serving it."""
        return STALL_S + (1 / self.limit if self.limit else 0.0)

    def problems(self) -> list[str]:
        out = list(self.errors[:1])
        if not self.complete and not self.errors:
            out.append("a request did not complete")
        if self.engine_tokens != self.client_tokens:
            out.append(f"engine {self.engine_tokens} tokens != client {self.client_tokens}")
        excess = self.excess
        if excess is not None and excess > TOLERANCE:
            out.append(f"over the bound by {excess:.2f} tokens")
        if largest_gap_s(self.steps) > self.allowed_gap_s:
            out.append(f"engine stalled {largest_gap_s(self.steps):.1f} s")
        return out


def measure(
    trace: Path, streams: list[Stream], since_ns: int, timeout_s: float = 3.0
) -> list[Measured]:
    """Each user's steps from the trace since `since_ns`. The engine flushes
    its trace every 100 ms: read again until it holds every token the client
    received (or `timeout_s` passes; a mismatch is then reported)."""
    deadline = time.monotonic() + timeout_s
    time.sleep(0.3)
    while True:
        lines = read_trace(trace)
        rows = [
            Measured(
                label,
                user,
                limit,
                [s for s in streams if s.user == user],
                max_tokens,
                user_tokens(lines, ANONYMOUS if user is None else user, since_ns),
            )
            for label, user, _, max_tokens, limit in USERS
        ]
        if all(r.engine_tokens >= r.client_tokens for r in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def report(rows: list[Measured]) -> bool:
    ok = True
    head = (
        f"{'user':<10} {'limit':>9} {'streams':>7} {'tokens':>6} {'engine tok/s':>12} "
        f"{'worst window':>12} {'worst 1 s':>9} {'gap ms':>6} {'client tok/s':>12}  result"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        problems = r.problems()
        ok &= not problems
        limit = "unlimited" if r.limit is None else f"{r.limit:g}"
        # + 0.0 turns a rounded -0.0 (exactly at the bound) into 0.00
        excess = "-" if r.excess is None else f"{round(r.excess, 2) + 0.0:.2f}"
        client = user_rate(r.streams, r.user).rate
        print(
            f"{r.label:<10} {limit:>9} {len(r.streams):>7} {r.engine_tokens:>6} "
            f"{engine_rate(r.steps):>12.1f} {excess:>12} {max_tokens_in(r.steps, 10**9):>9} "
            f"{largest_gap_s(r.steps) * 1000:>6.0f} {client:>12.1f}  "
            + ("FAIL  " + "; ".join(problems) if problems else "PASS")
        )
    print(
        f"""
Measured in the engine (its --outrate-trace: when the scheduler sampled each token):
  limit         tok/s from policies/demo.yaml (burst 100 ms)
  tokens        output tokens the engine charged the user, net of refunds
  engine tok/s  (tokens - 1) / (last step - first step) over all of the user's streams
  worst window  the largest  tokens in [t1, t2] - ((t2 - t1 + burst) x limit + 1)  over
                every window between two of the user's steps; <= 0: the GCRA bound held
  worst 1 s     the most tokens in any 1-second window
  gap ms        the longest time between two steps that gave the user tokens
Reported, not judged (two shared cores delay delivery, not sampling):
  client tok/s  (tokens - 1) / (last - first arrival) at the openai client
PASS: worst window <= 0 (+{TOLERANCE:g} for float rounding), every request completed, the
engine's tokens == the tokens the client received, and no stall: gap <= {STALL_S:g} s + 1/limit
(a throttled user waits ~1/limit between tokens; the unlimited one waits for nobody)."""
    )
    return ok


def plot(rows: list[Measured], t0_ns: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for i, r in enumerate(rows):
        colour = f"C{i}"
        limit = "unlimited" if r.limit is None else f"{r.limit:g} tok/s"
        times = [0.0] + [(t - t0_ns) / 1e9 for t, _ in r.steps]
        counts = [0]
        for _, k in r.steps:
            counts.append(counts[-1] + k)
        # Wide and pale underneath, so the client's thin dashed line stays
        # visible where the two agree.
        ax.step(
            times,
            counts,
            where="post",
            color=colour,
            lw=3,
            alpha=0.5,
            label=f"{r.label} ({limit})",
        )
        arrivals = [0.0] + [t - t0_ns / 1e9 for t in token_times(r.streams, r.user)]
        ax.step(arrivals, range(len(arrivals)), where="post", color=colour, lw=1, ls="--")
    ax.plot([], [], color="grey", lw=3, alpha=0.5, label="solid: sampled by the engine (trace)")
    ax.plot([], [], color="grey", lw=1, ls="--", label="dashed: received by the client")
    ax.set_xlabel("seconds since the requests were sent")
    ax.set_ylabel("cumulative output tokens")
    ax.set_title(
        "outrate on vLLM (tiny CPU model): output tokens per user\n"
        "solid: sampled by the engine; dashed: received by the client",
        fontsize=11,
    )
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo.png")
    parser.add_argument("--keep-log", action="store_true", help="print the server log path")
    args = parser.parse_args(argv)

    t = time.monotonic()
    model = build(REPO / "models" / "tiny-llama")
    print(f"tiny model ready ({time.monotonic() - t:.1f} s): {model}")
    run_dir = Path(tempfile.mkdtemp(prefix="outrate-demo-"))
    trace = run_dir / "trace.jsonl"
    argv_serve = outrate_serve_argv(
        model,
        POLICY,
        "--max-num-seqs",
        "16",
        "--max-num-active-seqs",
        "12",
        "--outrate-trace",
        str(trace),
    )
    server = ServerProcess(argv_serve, log_path=run_dir / "server.log", name="demo")
    print(
        f"starting outrate serve with {POLICY.relative_to(REPO)} (engine start takes 20-40 s; "
        f"log and trace in {run_dir})"
    )
    server.start(timeout_s=300, progress=lambda line: print("  " + line, flush=True))
    try:
        run_concurrently(server.base_url, [("warmup", 1, 8)])
        print("\ndriving 4 users for about 7 s ...\n")
        t0_ns = time.monotonic_ns()
        streams = run_concurrently(
            server.base_url, [(user, n, max_tokens) for _, user, n, max_tokens, _ in USERS]
        )
        rows = measure(trace, streams, t0_ns)
        ok = report(rows)
        plot(rows, t0_ns, args.out)
        print(f"\nplot: {args.out}")
    finally:
        server.stop()
    print("server stopped")
    if args.keep_log:
        print(f"server log: {server.log_path}\nengine trace: {trace}")
    if not ok:
        print(
            "FAIL: a limit was exceeded, a request did not complete or a user stalled",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
