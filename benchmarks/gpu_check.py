"""Verify outrate on your GPU: the seed's measurement, one table, on the engine's record.

    python benchmarks/gpu_check.py --model Qwen/Qwen2.5-0.5B-Instruct [-- VLLM ARGS]

On a machine with a GPU and vLLM installed (the `vllm` extra), it starts
`outrate serve MODEL` (vLLM's own `serve`, with the plugin) with a policy and
`--outrate-trace`, once with sync and once with async scheduling, and drives:

- a 20 tok/s user with 1 stream, and another with 4 streams;
- a 100 tok/s user beside them;

then reads what the engine recorded (the trace: when each token was
dispatched) and checks the contract: the GCRA bound in every window, and
from first to last token at least 95% of the rate, or of what the steps the
engine ran allowed where they were too few (`steps allowed`: a 1-stream
100 tok/s user needs 100 steps/s, which a starved CPU may not run). The
paced load is played once more if a thread of the server waited for a CPU
over a fifth of it: a busy host, not the limits. Last, throughput with limits
configured but never reached (on the sync server, after the paced users)
against stock vLLM (no outrate plugin but its CPU fixes,
`VLLM_PLUGINS=outrate_cpu`), the same load on each, medians of `--rounds`
rounds. Servers run one after another, so one GPU is enough.

It prints one table; paste it whole into an issue report. Exit code 1 if a
row fails. Without a GPU it runs on vLLM's CPU platform (the tiny local model
by default), where vLLM forces sync scheduling: the async row says so. `make
test` runs it that way as a smoke run (tests/test_bench_gpu_check.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

from loadgen import run_concurrently  # noqa: E402
from serverproc import STOCK_PLUGINS, ServerProcess, cpu_server_env, play_unstarved  # noqa: E402

from outrate.observe.trace import (  # noqa: E402
    engine_rate,
    max_window_excess,
    read_trace,
    steps_allowed_rate,
    user_tokens,
)

BURST_NS = 100_000_000
POLICY = """\
version: 1
default: 100000   # never reached: the throughput users
burst: 100ms
users:
  user-20-1: 20
  user-20-4: 20
  user-100: 100
"""
# (user, limit tok/s, streams)
PACED = (("user-20-1", 20, 1), ("user-20-4", 20, 4), ("user-100", 100, 1))
THROUGHPUT_USERS = 8


@dataclass
class Row:
    scheduling: str
    user: str
    limit: float
    streams: int
    tokens: int
    rate: float
    allowed: float
    excess: float
    ok: bool


def on_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def device_name() -> str:
    if on_gpu():
        import torch

        return str(torch.cuda.get_device_name(0))
    return "CPU (vLLM's CPU platform)"


def server_env(stock: bool = False) -> dict[str, str]:
    """The CPU harness's quiet, offline environment on CPU; the caller's own on
    a GPU (which may need to fetch the model). Stock loads only outrate's CPU
    fixes (a no-op on GPU platforms)."""
    env = dict(os.environ) if on_gpu() else cpu_server_env()
    if stock:
        env["VLLM_PLUGINS"] = STOCK_PLUGINS
    return env


def serve_argv(model: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "outrate", "serve", "--model", model, *extra]


def stock_argv(model: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *extra]


def pacing(
    model: str, extra: list[str], scheduling: str, args: argparse.Namespace, work: Path
) -> tuple[list[Row], float | None]:
    """The paced users on one outrate server; on the sync one, then the
    throughput rounds too (one server start fewer)."""
    policy = work / "policy.yaml"
    policy.write_text(POLICY)
    trace = work / f"trace-{scheduling}.jsonl"
    flag = "--async-scheduling" if scheduling == "async" else "--no-async-scheduling"
    argv = serve_argv(
        model, [*extra, flag, "--outrate-policy", str(policy), "--outrate-trace", str(trace)]
    )
    server = ServerProcess(
        argv, env=server_env(), log_path=work / f"outrate-{scheduling}.log", name=scheduling
    )
    rate = None
    with server.start(timeout_s=900):
        run_concurrently(server.base_url, [("warmup", 2, 16)])
        plan = [
            (user, streams, int(limit * args.seconds) // streams) for user, limit, streams in PACED
        ]

        def play() -> tuple[int, list]:
            return time.monotonic_ns(), run_concurrently(server.base_url, plan)

        # Played again once if the machine starved the server (a busy host:
        # CPU the engine waited for is not what the limits held back).
        since, streams = play_unstarved([server], play, lambda m: print(f"{scheduling}: {m}"))
        time.sleep(0.5)  # the trace is flushed every 100 ms
        if scheduling == "sync":
            rate = throughput(server, args.rounds, args.tokens)
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"{scheduling}: {errors[0]}")
    lines = [r for r in read_trace(trace) if "step" in r and r["t"] >= since]
    rows = []
    for user, limit, n in PACED:
        steps = user_tokens(lines, user)
        tokens = sum(k for _, k in steps)
        engine = engine_rate(steps)
        excess = max_window_excess(steps, limit, BURST_NS)
        allowed = min(limit, steps_allowed_rate(lines, steps, limit, BURST_NS, n))
        ok = excess <= 1e-6 and engine >= 0.95 * allowed and tokens > 0
        rows.append(Row(scheduling, user, limit, n, tokens, engine, allowed, excess, ok))
    return rows, rate


def throughput(server: ServerProcess, rounds: int, tokens: int) -> float:
    """Median output tok/s over `rounds` rounds of the same load."""
    plan = [(f"bulk-{i}", 2, tokens) for i in range(THROUGHPUT_USERS)]
    rates = []
    for _ in range(rounds):
        t0 = time.monotonic()
        streams = run_concurrently(server.base_url, plan)
        wall = time.monotonic() - t0
        errors = [s.error for s in streams if s.error]
        if errors:
            raise RuntimeError(f"{server.name}: {errors[0]}")
        rates.append(sum(s.completion_tokens for s in streams) / wall)
    return statistics.median(rates)


def stock_throughput(model: str, extra: list[str], args: argparse.Namespace, work: Path) -> float:
    argv = stock_argv(model, extra)
    server = ServerProcess(
        argv, env=server_env(stock=True), log_path=work / "stock.log", name="stock"
    )
    with server.start(timeout_s=900):
        run_concurrently(server.base_url, [("warmup", 2, 16)])
        return throughput(server, args.rounds, args.tokens)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the tiny local model (CPU)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the paced load")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per side")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per throughput stream")
    parser.add_argument("--target", type=float, default=0.97, help="throughput ratio to pass")
    args = parser.parse_args(args_in)
    gpu = on_gpu()
    model = args.model
    if model is None:
        from build_tiny_model import build
        from serverproc import tiny_model_flags

        model = str(build(REPO / "models" / "tiny-llama"))
        extra = [*tiny_model_flags(model)[2:], *extra]  # its flags, less --model
    work = Path(tempfile.mkdtemp(prefix="outrate-gpu-check-"))
    rows, ours = pacing(model, extra, "sync", args, work)
    if gpu:
        rows += pacing(model, extra, "async", args, work)[0]
    stock = stock_throughput(model, extra, args, work)
    assert ours is not None
    ratio = ours / stock

    from vllm_integration.common.versions import vllm_version

    print(f"\noutrate gpu_check: vLLM {vllm_version()}, {device_name()}, model {model}")
    print(f"flags: {' '.join(extra) or '(none)'}; logs and traces in {work}")
    head = f"{'scheduling':<11}{'user':<11}{'limit':>6}{'streams':>8}{'tokens':>8}"
    print(f"{head}{'engine tok/s':>13}{'steps allowed':>14}{'worst window':>13}  result")
    for r in rows:
        print(
            f"{r.scheduling:<11}{r.user:<11}{r.limit:>6.0f}{r.streams:>8}{r.tokens:>8}"
            f"{r.rate:>13.2f}{r.allowed:>14.2f}{r.excess:>13.2f}  {'PASS' if r.ok else 'FAIL'}"
        )
    if not gpu:
        print(f"{'async':<11}n/a: vLLM forces sync scheduling on its CPU platform")
    verdict = "PASS" if ratio >= args.target else "FAIL"
    print(
        f"throughput, limits never reached ({THROUGHPUT_USERS * 2} streams x {args.tokens} "
        f"tokens, median of {args.rounds}): stock {stock:.0f} tok/s, outrate {ours:.0f} "
        f"tok/s, ratio {ratio:.3f} (>= {args.target})  {verdict}"
    )
    print(
        "steps allowed: what an exact GCRA limiter grants at the steps the engine ran, a "
        "token a stream a step, capped at the limit; engine tok/s >= 0.95 x it passes"
    )
    print("worst window: max over windows of tokens - ((W + burst) x limit + 1); <= 0 holds")
    return 0 if all(r.ok for r in rows) and ratio >= args.target else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    sys.exit(main())
