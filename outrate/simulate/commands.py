"""`outrate simulate`: the commands (mounted on the `outrate` CLI in cli.py).

    outrate simulate POLICY --workload LOAD.yaml [options] [-- vllm serve flags]
    outrate simulate calibrate --trace TRACE.jsonl [--workload LOAD.yaml] [-o model.json]
    outrate simulate calibrate --metrics URL [--window S] [--interval S] [-o model.json]
    outrate simulate schema

Thin, like the rest of the CLI: each command calls one core function and
prints; exit 1 on a bad policy, workload, trace or deployment, 2 on usage.
vLLM is imported only by a run (`_runner`), so a bad file fails in a blink.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from outrate.argv import VLLM_ARGS, SplitAtDoubleDash
from outrate.errors import OutrateError, Problem
from outrate.observe.trace import read_trace
from outrate.simulate.agreement import format_agreement, rate_agreement
from outrate.simulate.engine import engine_from_flags
from outrate.simulate.size import Size
from outrate.simulate.stepmodel import StepModel, load_step_model
from outrate.simulate.study import ProgressFor, Runner, plan_configs, run_study
from outrate.simulate.tracefit import calibrate
from outrate.simulate.workload import load_workload, workload_json_schema


class Format(StrEnum):
    text = "text"
    json = "json"


class _RunByDefault(TyperGroup):
    """`outrate simulate POLICY ...` is `outrate simulate run POLICY ...`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


simulate_app = typer.Typer(
    name="simulate",
    cls=_RunByDefault,
    help="What a policy and an engine configuration do to each user, before deploying.",
    no_args_is_help=True,
)


def _err(line: str) -> None:
    typer.echo(line, err=True)


def _fail(e: OutrateError, output: Format = Format.text) -> typer.Exit:
    """Each problem on stderr, as always; where JSON was asked for, also a
    JSON error object on stdout (`{"ok": false, "errors": [...]}`: a located
    problem's path, line, col, field and message, or a message alone), so a
    program reading stdout gets JSON either way."""
    problems: tuple[Problem, ...] = getattr(e, "problems", ())
    for line in [str(p) for p in problems] or [str(e)]:
        _err(line)
    if output is Format.json:
        errors = [p._asdict() for p in problems] or [{"message": str(e)}]
        typer.echo(json.dumps({"ok": False, "errors": errors}, indent=2))
    return typer.Exit(1)


@contextmanager
def _progress_bar(shown: bool) -> Iterator[ProgressFor | None]:
    """A progress bar per run on stderr (simulated time, requests finished,
    ETA), only where stderr is a terminal; None elsewhere."""
    if not shown:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[simulated]} simulated, {task.fields[done]} requests done"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:

        def for_run(label: str, total_ns: int) -> Callable[[int, int], None]:
            task = bar.add_task(label or "simulating", total=total_ns, simulated="0s", done=0)

            def update(now_ns: int, done: int) -> None:
                bar.update(task, completed=now_ns, simulated=f"{now_ns / 1e9:.0f}s", done=done)

            return update

        yield for_run


def _runner() -> Runner:
    from vllm_integration.offline.simulator import simulate  # vLLM only when a run starts

    return simulate


@simulate_app.command("run", cls=SplitAtDoubleDash)
def run(
    ctx: typer.Context,
    policy: Annotated[
        str,
        typer.Argument(help="The policy file, or 'stock' for vLLM without outrate."),
    ],
    workload: Annotated[Path, typer.Option("--workload", "-w", help="The workload file.")],
    step_model: Annotated[
        Path | None,
        typer.Option("--step-model", help="A step-time model (`simulate calibrate -o`)."),
    ] = None,
    kv_cache_tokens: Annotated[
        int | None,
        typer.Option("--kv-cache-tokens", min=1, help="KV cache size in tokens."),
    ] = None,
    compare: Annotated[
        str | None, typer.Option("--compare", help="Another policy ('stock': none) to compare.")
    ] = None,
    compare_flags: Annotated[
        str | None,
        typer.Option("--compare-flags", help="More vllm serve flags for a second run: '--x 8'."),
    ] = None,
    sweep: Annotated[
        str | None,
        typer.Option("--sweep", help="One run per value: max-num-active-seqs=8,12,16."),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write PNG figures into this directory.")
    ] = None,
    output: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.text,
) -> None:
    """Run a workload through vLLM's real scheduler and outrate's policy on a
    virtual clock; print per-user and engine figures.

    vLLM serve flags go after `--`:  outrate simulate p.yaml -w load.yaml -- --max-num-seqs 64
    """
    flags = ctx.meta.get(VLLM_ARGS, [])
    text = output is Format.text

    def said(size: Size) -> None:
        if text:  # stderr: stdout is the table alone
            _err(size.describe())

    try:
        loaded = load_workload(workload)
        model = load_step_model(step_model) if step_model is not None else StepModel()
        kind, configs = plan_configs(policy, flags, compare, compare_flags, sweep)
        with _progress_bar(text and sys.stderr.isatty()) as progress:
            study = run_study(
                loaded, configs, kind, _runner(), model, kv_cache_tokens, progress, said
            )
    except OutrateError as e:
        raise _fail(e, output) from e
    if output is Format.json:
        typer.echo(json.dumps(study.to_json(), indent=2))
    else:
        typer.echo(study.text())
    if study.partial:
        _err("interrupted: the table is what was simulated until then")
        raise typer.Exit(130)
    if plot is not None:
        from outrate.simulate.plot import plot_runs  # matplotlib only for --plot

        runs = study.runs if kind != "sweep" else study.runs[:4]
        for path in plot_runs(runs, plot):
            _err(f"wrote {path}")


@simulate_app.command("calibrate", cls=SplitAtDoubleDash)
def calibrate_cmd(
    ctx: typer.Context,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="A trace (--outrate-trace) to fit.")
    ] = None,
    metrics: Annotated[
        str | None,
        typer.Option(
            "--metrics",
            help="Fit vLLM's own counters instead: an engine's /metrics URL (read over "
            "--window), or a Prometheus server's URL (the last --window it stored).",
        ),
    ] = None,
    window: Annotated[
        float, typer.Option("--window", min=0.1, help="Seconds of --metrics to fit.")
    ] = 60.0,
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.01, help="Seconds between two readings of --metrics."),
    ] = 1.0,
    match: Annotated[
        str | None,
        typer.Option(
            "--match", help="With a Prometheus --metrics: the series, '{instance=\"e:8000\"}'."
        ),
    ] = None,
    workload: Annotated[
        Path | None,
        typer.Option("--workload", "-w", help="The workload that ran (fits the prompt cost)."),
    ] = None,
    since_ns: Annotated[
        int, typer.Option("--since-ns", help="Only steps at or after this trace time.")
    ] = 0,
    out: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the model (JSON) here.")
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help="The engine's policy: with --workload, simulate the run and compare it.",
        ),
    ] = None,
    kv_cache_tokens: Annotated[
        int | None,
        typer.Option("--kv-cache-tokens", min=1, help="KV cache size in tokens."),
    ] = None,
    output: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.text,
) -> None:
    """Fit the step-time model to a real engine's trace, or to its /metrics;
    with the trace, the workload that ran and the engine's policy (and its
    flags after `--`), also simulate that run with the fitted model and print
    how far it is (in sample)."""
    if (trace is None) == (metrics is None):
        raise typer.BadParameter(
            "give one: a trace file or a metrics URL", param_hint="--trace / --metrics"
        )
    if metrics is not None and (workload or policy or since_ns):
        raise typer.BadParameter(
            "they go with --trace (the metrics count the prompt tokens themselves)",
            param_hint="--workload / --policy / --since-ns",
        )
    if trace is not None and match is not None:
        raise typer.BadParameter("it selects a Prometheus's series", param_hint="--match")
    if metrics is not None:
        _calibrate_metrics(metrics, window, interval, match, out, output)
        return
    assert trace is not None  # one of the two: checked above
    agreement = None
    try:
        ran = load_workload(workload).workload if workload is not None else None
        lines = [r for r in read_trace(trace) if r.get("t", 0) >= since_ns]
        result = calibrate(lines, ran, source=str(trace))
        if policy is not None and ran is not None:
            flags = ctx.meta.get(VLLM_ARGS, [])
            _, (config,) = plan_configs(policy, flags)
            engine = engine_from_flags(flags, kv_cache_tokens)
            run = _runner()(ran, engine, config.policy, result.model, "in sample")
            agreement = rate_agreement([r for r in lines if "step" in r], run)
    except OutrateError as e:
        raise _fail(e, output) from e
    _write_model(out, result.model)
    if output is Format.json:
        data = result.to_json()
        if agreement is not None:
            data["in_sample"] = {
                r.user: {"engine": round(r.engine, 3), "simulated": round(r.simulated, 3)}
                for r in agreement
            }
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(result.describe())
        if agreement is not None:
            typer.echo(format_agreement(agreement, "in sample"))


def _calibrate_metrics(
    url: str, window: float, interval: float, match: str | None, out: Path | None, output: Format
) -> None:
    """`calibrate --metrics`: read vLLM's counters, fit them, print."""
    from outrate.simulate import counters, metricsfit  # prometheus_client only for --metrics

    if output is Format.text and counters.engine_page(url):  # a minute without a word otherwise
        _err(f"reading {url} every {interval:g}s for {window:g}s")
    try:
        readings = counters.read_metrics(url, window, interval, match)
        result = metricsfit.calibrate_metrics(readings, source=url)
    except OutrateError as e:
        raise _fail(e, output) from e
    _write_model(out, result.model)
    typer.echo(
        json.dumps(result.to_json(), indent=2) if output is Format.json else result.describe()
    )


def _write_model(out: Path | None, model: StepModel) -> None:
    if out is not None:
        out.write_text(json.dumps(model.to_json(), indent=2) + "\n")
        _err(f"wrote {out}")


@simulate_app.command("schema")
def schema() -> None:
    """Print the JSON Schema of workload files (for editors)."""
    typer.echo(json.dumps(workload_json_schema(), indent=2, sort_keys=True))
