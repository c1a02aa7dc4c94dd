"""End-to-end output throughput: outrate with limits configured but never
reached, against stock vLLM serving the same tiny model, in the same run.

    python benchmarks/bench_e2e.py [--rounds 3] [--check]

Starts stock vLLM (plugins off), measures, stops it; starts `outrate serve`
with a policy whose limits no user reaches, measures, stops it; and repeats
the pair `--pairs` times so slow drift of this shared machine hits both sides.
Each round sends STREAMS concurrent streamed completions (ignore_eos) through
the `openai` client, spread over USERS users, and counts output tokens per
second of wall time. Prints the median of each side and the ratio (target:
outrate >= 0.97 x stock).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

from build_tiny_model import build  # noqa: E402
from loadgen import run_concurrently  # noqa: E402
from serverproc import (  # noqa: E402
    ServerProcess,
    outrate_serve_argv,
    stock_vllm_argv,
    stock_vllm_env,
)

USERS = 8
STREAMS = 16
MAX_TOKENS = 200
TARGET = 0.97

# Every user limited, at a rate no stream of the tiny CPU model reaches.
POLICY = "version: 1\ndefault: 100000\nanonymous: 100000\n"


def measure(server: ServerProcess, rounds: int) -> list[float]:
    run_concurrently(server.base_url, [("warmup", 2, 32)])
    plan = [(f"user-{i}", STREAMS // USERS, MAX_TOKENS) for i in range(USERS)]
    rates = []
    for _ in range(rounds):
        t0 = time.monotonic()
        streams = run_concurrently(server.base_url, plan)
        wall = time.monotonic() - t0
        errors = [s.error for s in streams if s.error]
        if errors:
            raise RuntimeError(errors[0])
        rates.append(sum(s.completion_tokens for s in streams) / wall)
    return rates


def run(pairs: int, rounds: int) -> tuple[list[float], list[float]]:
    model = build(REPO / "models" / "tiny-llama")
    policy = Path(tempfile.mkdtemp()) / "untriggered.yaml"
    policy.write_text(POLICY)
    common = ["--max-num-seqs", "16"]
    stock_argv = stock_vllm_argv(model, *common)
    ours_argv = outrate_serve_argv(model, policy, *common, "--outrate-reload", "off")
    stock: list[float] = []
    ours: list[float] = []
    for pair in range(pairs):
        for name, argv, env, sink in (
            ("stock vLLM", stock_argv, stock_vllm_env(), stock),
            ("outrate", ours_argv, None, ours),
        ):
            server = ServerProcess(argv, env=env, name=name.replace(" ", "-"))
            print(f"[pair {pair + 1}/{pairs}] starting {name} ...", flush=True)
            server.start(timeout_s=300)
            try:
                got = measure(server, rounds)
            finally:
                server.stop()
            print(f"  {name}: {', '.join(f'{r:.0f}' for r in got)} tok/s", flush=True)
            sink.extend(got)
    return stock, ours


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="exit 1 if the target is missed")
    args = parser.parse_args(argv)
    stock, ours = run(args.pairs, args.rounds)
    s, o = statistics.median(stock), statistics.median(ours)
    ratio = o / s
    print(f"\n{STREAMS} streams x {MAX_TOKENS} tokens over {USERS} users, tiny model on CPU")
    print(f"stock vLLM  median {s:7.0f} tok/s  ({len(stock)} rounds)")
    print(
        f"outrate     median {o:7.0f} tok/s  ({len(ours)} rounds, limits configured, not reached)"
    )
    print(f"ratio {ratio:.3f}  target >= {TARGET}  {'PASS' if ratio >= TARGET else 'FAIL'}")
    return 1 if args.check and ratio < TARGET else 0


if __name__ == "__main__":
    sys.exit(main())
