"""The `outrate` command. Thin on purpose: each command calls one core function,
prints, and picks the exit code (0 ok, 1 policy or deployment errors, 2 usage).

Nothing here imports vLLM at import time, so `outrate lint` starts in a blink
and runs where vLLM is not installed; `outrate serve` imports it when run.
"""

from __future__ import annotations

import json
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from outrate.argv import VLLM_ARGS, SplitAtDoubleDash
from outrate.check.deployment import Deployment, load_deployment
from outrate.check.lint import LintReport, lint_all
from outrate.errors import OutrateError
from outrate.identity.core import identity_error
from outrate.policy.keys import add_key, revoke_keys
from outrate.policy.model import policy_json_schema
from outrate.simulate.commands import simulate_app
from outrate.units import format_count

app = typer.Typer(
    name="outrate",
    help="Per-user output-token rate limits for vLLM.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


class Format(StrEnum):
    text = "text"
    json = "json"


def _err(line: str) -> None:
    typer.echo(line, err=True)


@app.command(cls=SplitAtDoubleDash)
def lint(
    ctx: typer.Context,
    policies: Annotated[
        list[str],
        typer.Argument(help="Policy YAML files, each checked.", metavar="POLICY"),
    ],
    vllm_config: Annotated[
        Path | None,
        typer.Option(
            "--vllm-config",
            help="A `vllm serve --config` YAML file to check too.",
            readable=False,  # an unreadable file is a located error (exit 1), not usage
        ),
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Fail on warnings too.")] = False,
    output: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.text,
) -> None:
    """Check policies, and the vLLM deployment they will run under.

    vLLM serve arguments go after `--`:  outrate lint p.yaml -- -tp 2 --max-num-seqs 64
    """
    argv = ctx.meta.get(VLLM_ARGS, [])
    deployment: Deployment | None = None
    if vllm_config is not None or argv:
        try:
            deployment = load_deployment(vllm_config, argv or None, strict_flags=True)
        except OutrateError as e:
            _err(str(e))
            if output is Format.json:
                typer.echo(json.dumps({"ok": False, "errors": [{"message": str(e)}]}, indent=2))
            raise typer.Exit(1) from e
    named = deployment.policy if deployment is not None else None
    if named is not None and os.path.abspath(named) not in map(os.path.abspath, policies):
        policies = [*policies, named]  # the server would load it: lint it as well
    reports = [lint_all(path, deployment) for path in policies]
    if output is Format.json:
        if len(reports) == 1:
            data = reports[0].to_json(strict)
        else:
            files = [{"source": r.source, **r.to_json(strict)} for r in reports]
            data = {"ok": all(r.ok(strict) for r in reports), "files": files}
        typer.echo(json.dumps(data, indent=2))
    else:
        printed: set[str] = set()  # deployment findings once, not once per file
        for report in reports:
            _print_text(report, strict, printed)
    raise typer.Exit(0 if all(r.ok(strict) for r in reports) else 1)


def _print_text(report: LintReport, strict: bool, printed: set[str]) -> None:
    for problem in report.problems:  # exactly the loader's messages
        _err(str(problem))
    for finding in report.findings:
        line = str(finding)
        if finding.code != "OR000" and line not in printed:
            printed.add(line)
            _err(line)
    errors, warnings = len(report.errors), len(report.warnings)
    counts = f"{format_count(errors, 'error')}, {format_count(warnings, 'warning')}"
    if not report.ok(strict):
        why = " (--strict)" if strict and not errors else ""
        typer.echo(f"{report.source}: failed{why}: {counts}")
    elif report.policy is not None:
        noted = f", {format_count(warnings, 'warning')}" if warnings else ""
        typer.echo(f"ok{noted}: {report.policy.summary()}")
    if report.shadow:
        typer.echo(f"shadow (counted, not enforced): {', '.join(report.shadow)}")


@app.command()
def schema() -> None:
    """Print the JSON Schema of policy files (for editors: yaml-language-server)."""
    typer.echo(schema_text(), nl=False)


def schema_text() -> str:
    """The schema exactly as shipped in policies/policy.schema.json."""
    return json.dumps(policy_json_schema(), indent=2, sort_keys=True) + "\n"


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def serve(ctx: typer.Context) -> None:
    """Run `vllm serve` in-process with outrate loaded; every argument goes to vLLM."""
    from vllm_integration.startup.launcher import main as launch  # vLLM only when serving

    raise typer.Exit(launch(list(ctx.args)))


@app.command()
def doctor() -> None:
    """Check the installed vLLM before a restart: its version against the tested
    range, every patch target outrate uses (found, moved, missing, changed), the
    scheduler's overrides against vLLM's signatures, and the CPU fixes. Exit 1
    where outrate would not start."""
    from vllm_integration.startup.doctor import main as run  # vLLM only when asked

    raise typer.Exit(run())


@app.command()
def top(
    url: Annotated[
        str,
        typer.Argument(
            help="The vLLM server (http://host:port) or its /metrics URL.", show_default=False
        ),
    ],
    interval: Annotated[
        float, typer.Option("--interval", min=0.05, help="Seconds between scrapes.")
    ] = 1.0,
    once: Annotated[
        bool, typer.Option("--once", help="Print one table (two scrapes --interval apart), exit.")
    ] = False,
    limit_filter: Annotated[
        str | None,
        typer.Option("--limit-filter", metavar="GLOB", help="Only limits matching GLOB: 'tier:*'."),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=0.05,
            help="Seconds a whole scrape may take: connect, headers and body.",
        ),
    ] = 5.0,
) -> None:
    """Per-limit rates, held requests and throttling, live from a server's /metrics."""
    from outrate.observe import top as view  # prometheus_client only for `top`: `lint` stays quick

    try:
        target = view.metrics_url(url)
    except OutrateError as e:
        raise typer.BadParameter(str(e), param_hint="URL") from e
    show = view.once if once else view.watch
    try:
        show(
            target,
            interval=interval,
            timeout=timeout,
            console=view.make_console(),
            limit_filter=limit_filter,
        )
    except OutrateError as e:
        _err(f"outrate top: {e}")
        raise typer.Exit(1) from e
    except KeyboardInterrupt:
        if once:
            raise  # an interrupted --once printed nothing: not a success
        raise typer.Exit(0) from None


keys_app = typer.Typer(
    name="keys",
    help="Manage the API keys file of `identity: {source: api_key}`.",
    no_args_is_help=True,
)
app.add_typer(keys_app)
app.add_typer(simulate_app)  # outrate simulate (outrate/simulate/commands.py)

KeysFile = Annotated[
    Path,
    typer.Option(
        "--file",
        help="The keys file (the policy's identity.keys).",
        show_default=False,
        readable=False,
    ),
]


@keys_app.command("add")
def keys_add(
    user: Annotated[str, typer.Argument(help="The user id the key identifies.")],
    file: KeysFile,
) -> None:
    """Create a key for USER: print it once (stdout) and append its digest.

    Only the SHA-256 digest is written; the key cannot be shown again. A
    running server applies the edit within a second.
    """
    bad = identity_error(user, "USER")
    if bad is not None:
        raise typer.BadParameter(bad.removeprefix("USER "), param_hint="USER")
    try:
        key, digest = add_key(file, user)
    except OutrateError as e:
        _err(str(e))
        raise typer.Exit(1) from e
    typer.echo(key)
    _err(f"added {digest} for {user!r} to {file}; the key above is not stored anywhere")


@keys_app.command("revoke")
def keys_revoke(
    who: Annotated[
        str, typer.Argument(help="A user id (all its keys) or a digest (sha256:<hex>).")
    ],
    file: KeysFile,
) -> None:
    """Remove every key of a user, or the key with one digest."""
    try:
        gone = revoke_keys(file, who)
    except OutrateError as e:
        _err(str(e))
        raise typer.Exit(1) from e
    for digest, user in gone:
        typer.echo(f"revoked {digest} ({user!r})")


@app.command()
def quota(
    file: Annotated[
        Path | None,
        typer.Option(
            "--file", help="The engine's --outrate-quota-file.", show_default=False, readable=False
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            metavar="URL",
            help="The engines' --outrate-store, where they share quota usage "
            "(password: the URL's, else OUTRATE_STORE_PASSWORD).",
            show_default=False,
        ),
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option("--policy", help="Also show each user's quota in force and what is left."),
    ] = None,
    reset: Annotated[
        str | None,
        typer.Option("--reset", metavar="USER", help="Forget USER's usage in every window."),
    ] = None,
) -> None:
    """Each user's token usage per quota window, or an operator's reset.

    From the engine's quota file (--file) or, where engines share usage,
    their store (--store). A running engine applies a reset within a second
    (its saves read FILE.resets, or the store's reset mark), and a stopped
    one when it starts.
    """
    from outrate.budget.quotafile import read_usage, request_reset
    from outrate.budget.shared.usage import operator_link
    from outrate.contract.quotas import usage_lines
    from outrate.policy.pipeline import load_compiled

    if (file is None) == (store is None):
        raise typer.BadParameter(
            "give exactly one (the engine's quota file, or the store its engines share)",
            param_hint="'--file' / '--store'",
        )
    bad = None if reset is None else identity_error(reset, "USER")
    if bad is not None:
        raise typer.BadParameter(bad.removeprefix("USER "), param_hint="--reset")
    if file is not None and not file.is_file():
        _err(f"{file}: no such quota file (the engine writes it within a second of starting)")
        raise typer.Exit(1)
    try:
        if reset is not None:
            if store is None:
                had, where = request_reset(str(file), reset), "the file"
            else:
                with operator_link(store, "--store") as link:
                    had, where = bool(link.usage_of([reset])[reset]), "the store"
                    link.reset(reset)
            typer.echo(f"reset {reset!r}" + ("" if had else f" (no usage in {where})"))
            return
        compiled = load_compiled(policy) if policy is not None else None
        if store is None:
            users = read_usage(str(file))[0]
        else:
            with operator_link(store, "--store") as link:
                users = link.all_usage()
        lines = usage_lines(users, compiled)
    except (OutrateError, ValueError, OSError) as e:
        _err(f"outrate quota: {e}")
        raise typer.Exit(1) from e
    for line in lines:
        typer.echo(line)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover - `python -m outrate.cli`
    main()
