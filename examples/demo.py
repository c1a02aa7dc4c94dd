"""`make demo`: outrate enforcing a policy on a real vLLM engine, start to finish.

1. builds (or reuses) the tiny local Llama in models/tiny-llama;
2. starts `outrate serve` on 127.0.0.1 with policies/demo.yaml;
3. drives four users at once through the official `openai` client, streaming:
   user-a (4 streams, limit 20 tok/s), user-b (1 stream, 100 tok/s),
   user-c (unlimited) and anonymous requests (2 streams sharing 50 tok/s);
4. prints a per-user table (limit, measured tok/s, the GCRA bound, pass/fail)
   and writes a plot of cumulative output tokens per user to out/demo.png;
5. stops the server. Exits 1 if any user got more than its bound allows.

Every number it prints is measured in this run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_tiny_model import build  # noqa: E402
from loadgen import Stream, run_concurrently, throughput, token_times, user_rate  # noqa: E402
from serverproc import ServerProcess, outrate_serve_argv  # noqa: E402

POLICY = REPO / "policies" / "demo.yaml"
BURST_S = 0.1

# (label, user id sent, streams, max_tokens per stream, limit in tok/s or None)
USERS: list[tuple[str, str | None, int, int, float | None]] = [
    ("user-a", "user-a", 4, 35, 20),
    ("user-b", "user-b", 1, 700, 100),
    ("user-c", "user-c", 1, 1500, None),
    ("anonymous", None, 2, 175, 50),
]


def plot(streams: list[Stream], t0: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, user, _, _, limit in USERS:
        times = [t - t0 for t in token_times(streams, user)]
        ax.step(
            times,
            range(1, len(times) + 1),
            where="post",
            label=f"{label} ({'unlimited' if limit is None else f'{limit:g} tok/s'})",
        )
    ax.set_xlabel("seconds since the requests were sent")
    ax.set_ylabel("cumulative output tokens")
    ax.set_title("outrate on vLLM (tiny CPU model): output tokens per user")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(streams: list[Stream]) -> bool:
    ok = True
    cols = ("user", "streams", "limit", "tokens", "measured", "bound")
    head = "{:<10} {:>7} {:>10} {:>7} {:>12} {:>7}  result".format(*cols)
    print(head)
    print("-" * len(head))
    for label, user, n, max_tokens, limit in USERS:
        mine = [s for s in streams if s.user == user]
        errors = [s.error for s in mine if s.error]
        ur = user_rate(mine, user)
        complete = not errors and all(s.completion_tokens == max_tokens for s in mine)
        if limit is None:
            measured = f"{throughput(mine, user):8.1f} tok/s"
            bound, good = "-", complete
        else:
            measured = f"{ur.rate:8.1f} tok/s"
            b = ur.bound(limit, BURST_S)
            bound, good = f"{b:7.1f}", complete and ur.tokens <= b
        ok &= good
        limit_text = "unlimited" if limit is None else f"{limit:g} tok/s"
        print(
            f"{label:<10} {n:>7} {limit_text:>10} {ur.tokens:>7} {measured:>12} {bound:>7}  "
            f"{'PASS' if good else 'FAIL'}{'  ' + errors[0] if errors else ''}"
        )
    print(
        "\nmeasured = (tokens - 1) / (last token - first token) over all of a user's streams "
        "(unlimited: tokens / time since sent);\nbound = (W + burst) x limit + 1, the most GCRA "
        "allows in W = from sending the first request to the last token (burst 100 ms)."
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo.png")
    parser.add_argument("--keep-log", action="store_true", help="print the server log path")
    args = parser.parse_args(argv)

    t = time.monotonic()
    model = build(REPO / "models" / "tiny-llama")
    print(f"tiny model ready ({time.monotonic() - t:.1f} s): {model}")
    argv_serve = outrate_serve_argv(
        model, POLICY, "--max-num-seqs", "16", "--max-num-active-seqs", "12"
    )
    server = ServerProcess(argv_serve, name="demo")
    print(
        f"starting outrate serve with {POLICY.relative_to(REPO)} (engine start takes 20-40 s; "
        f"log: {server.log_path})"
    )
    server.start(timeout_s=300, progress=lambda line: print("  " + line, flush=True))
    try:
        run_concurrently(server.base_url, [("warmup", 1, 8)])
        print("\ndriving 4 users for about 7 s ...\n")
        t0 = time.monotonic()
        streams = run_concurrently(
            server.base_url, [(user, n, max_tokens) for _, user, n, max_tokens, _ in USERS]
        )
        ok = report(streams)
        plot(streams, t0, args.out)
        print(f"\nplot: {args.out}")
    finally:
        server.stop()
    print("server stopped")
    if not ok:
        print("FAIL: a limit was exceeded or a request did not complete", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
