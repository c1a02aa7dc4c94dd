"""One `outrate simulate` question, asked once, side by side, or as a sweep.

Everything but the engine run itself: reading the workload, the policy (with
the compiler the engine uses, so a bad policy fails here, in a blink, before
vLLM is imported), the engine flags and the step model; the configurations
to run (one; two with `--compare` or `--compare-flags`; one per value with
`--sweep`); and rendering the answer. The run is a `Runner` handed in by
the command (vllm_integration.offline.simulator.simulate): this package never
imports vLLM.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from outrate.errors import OutrateError
from outrate.policy.pipeline import load_compiled
from outrate.simulate.engine import engine_from_flags, with_flag
from outrate.simulate.report import RunResult, format_compare, format_run
from outrate.simulate.size import Size, check_fits, size_of
from outrate.simulate.stepmodel import StepModel
from outrate.simulate.workload import LoadedWorkload

STOCK = "stock"
"""As a policy: no outrate, vLLM's own scheduler (unless a file has that name)."""

Runner = Callable[..., RunResult]
"""(workload, engine, policy or None, step model, label, progress=callback)."""
ProgressFor = Callable[[str, int], "Callable[[int, int], None] | None"]
"""(label, simulated ns in all) -> the run's progress callback, or None."""


@dataclass(frozen=True)
class Config:
    """One configuration to run: a policy (None: stock) and the engine flags."""

    label: str
    policy: str | None
    flags: tuple[str, ...]


@dataclass
class Study:
    workload: LoadedWorkload
    step_model: StepModel
    kind: str  # "run" | "compare" | "sweep"
    configs: list[Config]
    runs: list[RunResult] = field(default_factory=list)
    size: Size | None = None

    @property
    def partial(self) -> bool:
        """A run was stopped (Ctrl-C): the runs after it never started."""
        return any(r.partial for r in self.runs) or len(self.runs) < len(self.configs)

    def text(self) -> str:
        head = [
            f"workload {self.workload.source}: {len(self.workload.workload.expanded())} users, "
            f"{self.workload.workload.duration / 1e9:g}s simulated",
            self.step_model.describe(),
            self.step_model.provenance(),
        ]
        if self.kind == "compare" and len(self.runs) == 2:
            body = [format_compare(self.runs[0], self.runs[1])]
        else:
            body = [format_run(r) for r in self.runs]
        return "\n\n".join(["\n".join(head), *body])

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload.source,
            "kind": self.kind,
            "step_model": self.step_model.to_json(),
            "partial": self.partial,
            "runs": [r.to_json() for r in self.runs],
        }


def resolve_policy(policy: str) -> str | None:
    """The policy file, checked by the engine's own compiler; `stock`: none."""
    if policy == STOCK and not os.path.exists(policy):
        return None
    load_compiled(policy)  # raises PolicyError with file:line:col
    return policy


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """`max-num-active-seqs=8,12,16` -> ("max-num-active-seqs", ["8", "12", "16"])."""
    name, eq, values = spec.partition("=")
    name = name.strip().removeprefix("--")
    points = [v.strip() for v in values.split(",") if v.strip()]
    if not eq or not name or not points:
        raise OutrateError(f"--sweep {spec!r}: expected FLAG=V1,V2,... (max-num-active-seqs=8,12)")
    return name, points


def _label(policy: str | None, flags: tuple[str, ...]) -> str:
    shown = os.path.basename(policy) if policy else STOCK
    return f"{shown} -- {shlex.join(flags)}" if flags else shown


def plan_configs(
    policy: str,
    flags: list[str],
    compare: str | None = None,
    compare_flags: str | None = None,
    sweep: str | None = None,
) -> tuple[str, list[Config]]:
    """The configurations one command asks for (checked, not run)."""
    if sum(x is not None for x in (compare, compare_flags, sweep)) > 1:
        raise OutrateError("give at most one of --compare, --compare-flags and --sweep")
    first = resolve_policy(policy)
    base = tuple(flags)
    if sweep is not None:
        name, points = parse_sweep(sweep)
        configs = []
        for value in points:
            argv = tuple(with_flag(list(base), name, value))
            configs.append(Config(f"{_label(first, base)} | {name}={value}", first, argv))
        return "sweep", configs
    configs = [Config(_label(first, base), first, base)]
    if compare is not None:
        other = resolve_policy(compare)
        configs.append(Config(_label(other, base), other, base))
        return "compare", configs
    if compare_flags is not None:
        more = tuple([*base, *shlex.split(compare_flags)])
        configs.append(Config(_label(first, more), first, more))
        return "compare", configs
    return "run", configs


def run_study(
    loaded: LoadedWorkload,
    configs: list[Config],
    kind: str,
    runner: Runner,
    step_model: StepModel,
    kv_cache_tokens: int | None = None,
    progress: ProgressFor | None = None,
    on_size: Callable[[Size], None] | None = None,
) -> Study:
    """Every configuration's engine is read first (a bad flag fails before
    any run), and the plan's size checked (one too big for memory fails
    before anything is drawn); then each runs the same workload. A run
    stopped by Ctrl-C ends the study: what was simulated is returned."""
    engines = [engine_from_flags(list(c.flags), kv_cache_tokens) for c in configs]
    size = max(
        (size_of(loaded.workload, e, step_model) for e in engines), key=lambda z: z.memory_bytes
    )
    size = replace(size, runs=len(configs))
    check_fits(size)
    if on_size is not None:
        on_size(size)
    study = Study(loaded, step_model, kind, configs, size=size)
    duration = loaded.workload.duration
    for config, engine in zip(configs, engines, strict=True):
        callback = progress(config.label, duration) if progress is not None else None
        result = runner(
            loaded.workload, engine, config.policy, step_model, config.label, progress=callback
        )
        study.runs.append(result)
        if result.partial:
            break
    return study
