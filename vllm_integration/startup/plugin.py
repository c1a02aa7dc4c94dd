"""The `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts (API server, engine core,
workers), possibly more than once; it is cheap and idempotent and imports vLLM
lazily. On a vLLM outside `compat.SUPPORTED` it logs one warning and does
nothing else. It patches two static/class methods of vLLM's `EngineArgs`:

- `add_cli_args`: adds the outrate flags to vLLM's own parser (so they show
  in `vllm serve --help` and parse like any vLLM flag);
- `from_cli_args`: when a policy is given, validates it and the deployment
  (fail fast, with the file:line message), selects the outrate scheduler via
  `scheduler_cls`, and carries the settings to the engine-core process in
  `additional_config["outrate"]`, and adds outrate's identity guard to
  `--middleware` (vllm_integration/apiserver/guards.py), handing it the policy's
  `identity:` section (vllm_integration/apiserver/identity.py).

And one module global, `_SENSITIVE_ARG_FIELDS` (whose module moved in vLLM
0.33; `compat.locate` finds it), gains `outrate_store`, so the startup log line of
non-default arguments shows the store URL (which may carry a password) as
`***` (`_redact_store_url`).

Without the flags nothing changes: no scheduler is swapped, no hook installed.
Only the CPU platform fixes apply in every process (`register_cpu_fixes`): the
AMX permission request (cpu_amx.py) and, when set, the spin sleep (cpu_spin.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from typing import Any

logger = logging.getLogger("vllm.outrate")

_registered = False
_warned = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_integration.common.compat import PatchError
    from vllm_integration.common.versions import is_supported, vllm_version

    version = vllm_version()
    if not is_supported(version) and not _untested_ok(version):
        _stay_out(version)
        return
    try:
        _register()
    except PatchError as exc:
        raise SystemExit(f"outrate: {exc}") from exc


def _untested_ok(version: str) -> bool:
    """A vLLM newer than the tested range runs outrate only when the operator
    opted in to exactly this version and `outrate doctor` finds every target
    of the index (the newest tested column) and every scheduler override.
    Logged at every start, and shown on /metrics (`outrate_vllm_info`)."""
    from vllm_integration.common.versions import opted_in, untested_message

    if not opted_in(version):
        return False
    from vllm_integration.startup.doctor import diagnose, targets_ok

    findings = diagnose()
    if not targets_ok(findings):
        bad = "; ".join(f"{f.what}: {f.status}: {f.detail}" for f in findings[1:] if f.fails)
        logger.warning("outrate: vLLM %s was opted in, but %s", version, bad)
        return False
    logger.warning("outrate: %s", untested_message(version))
    return True


def _stay_out(version: str) -> None:
    """An unsupported vLLM runs as shipped: one warning, nothing patched. A
    command line that asks for outrate exits 1 with the reason instead of
    argparse's usage error, since the flags are not there."""
    from vllm_integration.common.versions import unsupported_message

    global _warned
    message = unsupported_message(version)
    asked = [arg.split("=")[0] for arg in sys.argv[1:] if arg.split("=")[0] in OUTRATE_FLAGS]
    if asked:
        raise SystemExit(f"outrate: {message}; {asked[0]} cannot be honoured")
    if not _warned:  # both entry points may find it: one line
        _warned = True
        logger.warning("outrate: %s", message)


def _register() -> None:
    from vllm_integration.common.compat import owner_of

    _apply_cpu_fixes()  # the version was checked by register()
    from vllm_integration.apiserver.metrics import install_in_spawned_api_server

    install_in_spawned_api_server()  # --api-server-count > 1: /metrics in each of them
    EngineArgs = owner_of("EngineArgs.add_cli_args")  # the class that owns both

    stock_add = EngineArgs.add_cli_args
    stock_from = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser: Any) -> Any:
        parser = stock_add(parser)
        add_outrate_args(parser)
        _redact_store_url()
        return parser

    def from_cli_args(cls: Any, args: argparse.Namespace) -> Any:
        return apply_outrate_args(stock_from(cls, args), args)

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)


def register_cpu_fixes() -> None:
    """The fixes for vLLM's CPU platform alone (entry point `outrate_cpu`).

    `register()` applies them too. They have an entry point of their own so
    that stock vLLM, run with `VLLM_PLUGINS=outrate_cpu` (examples/serverproc.py),
    gets the same AMX request and the same engine-loop wait as outrate and
    nothing else. On an unsupported vLLM it stays out, as `register()` does.
    vLLM calls this outside any `try`: a failure here is logged, never raised,
    so it cannot take `vllm serve` down.
    """
    from vllm_integration.common.versions import is_supported, opted_in, vllm_version

    version = vllm_version()
    if not is_supported(version) and not opted_in(version):
        _stay_out(version)
        return
    _apply_cpu_fixes()


def _apply_cpu_fixes() -> None:
    from vllm_integration.startup.cpu_amx import enable_amx
    from vllm_integration.startup.cpu_spin import install_spin_sleep

    try:
        install_spin_sleep()  # only with OUTRATE_SHM_SPIN_SLEEP_US set (see cpu_spin.py)
        enable_amx()  # only on vLLM's CPU platform with an AMX CPU (see cpu_amx.py)
    except Exception:  # noqa: BLE001 - see the docstring
        logger.exception("outrate: a CPU platform fix failed; vLLM runs without it")


def _redact_store_url() -> None:
    """vLLM logs every non-default argument at startup, except the names in
    `_SENSITIVE_ARG_FIELDS`: add `outrate_store` there, so the
    store URL (which may carry a password) is printed as `***`. Can go when
    vLLM lets plugins mark their arguments sensitive."""
    from vllm_integration.common.compat import locate

    [(module, name)] = locate("_SENSITIVE_ARG_FIELDS")  # moved in vLLM 0.33
    fields = getattr(module, name)
    if "outrate_store" not in fields:
        setattr(module, name, frozenset({*fields, "outrate_store"}))


OUTRATE_FLAGS = (
    "--outrate-policy",
    "--outrate-reload",
    "--outrate-trace",
    "--outrate-trace-max-bytes",
    "--outrate-store",
    "--outrate-store-fallback",
    "--outrate-store-hold-s",
    "--outrate-store-engines",
    "--outrate-store-lease-ms",
    "--outrate-quota-file",
    "--default-user-output-tokens-per-second",
    "--user-output-tokens-per-second",
)
"""Every flag `add_outrate_args` adds (a test keeps the two equal)."""


def add_outrate_args(parser: Any) -> None:
    """The flags, with the types and choices of `outrate.check.outrate_flags.FLAGS`
    (the checks lint and `outrate_settings` run on them)."""
    if "--outrate-policy" in getattr(parser, "_option_string_actions", {}):
        return
    from outrate.check.outrate_flags import BY_NAME

    def typed(name: str) -> dict[str, Any]:
        flag = BY_NAME[name]
        kind: dict[str, Any] = {} if flag.type is str else {"type": flag.type}
        return kind if flag.choices is None else {**kind, "choices": list(flag.choices)}

    group = parser.add_argument_group(
        title="outrate",
        description="Per-user output-token rate limits enforced in the scheduler.",
    )
    group.add_argument(
        "--outrate-policy",
        default=None,
        metavar="PATH",
        help="YAML policy with per-user output-token rate limits (see `outrate lint`). "
        "The user is `vllm_xargs.output_rate_user` in each request, or, with the "
        "policy's identity section, a gateway's header or an API key.",
    )
    group.add_argument(
        "--outrate-reload",
        **typed("--outrate-reload"),
        default="watch",
        help="Apply edits of the policy file to the running engine: watch (inotify, "
        "default), poll (stat every 0.5 s: network filesystems) or off.",
    )
    group.add_argument(
        "--outrate-trace",
        default=None,
        metavar="PATH",
        help="Write the engine-side token trace (JSON lines, one per scheduler step that "
        "charged, refunded, held or released anything) to PATH.",
    )
    group.add_argument(
        "--outrate-trace-max-bytes",
        **typed("--outrate-trace-max-bytes"),
        default=None,
        metavar="N",
        help="Stop writing the trace at N bytes (default 256 MiB).",
    )
    group.add_argument(
        "--outrate-store",
        default=None,
        metavar="URL",
        help="Share each user's budget with every engine using the same Redis: "
        "redis://[:PASSWORD@]HOST:PORT/DB (rediss:// for TLS), a Redis Cluster "
        "redis+cluster://HOST:PORT[,HOST:PORT...]/, or a primary named by Sentinels "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME/DB (the password may instead "
        "come from $OUTRATE_STORE_PASSWORD; it is never logged). Needed for "
        "--data-parallel-size > 1.",
    )
    group.add_argument(
        "--outrate-store-fallback",
        **typed("--outrate-store-fallback"),
        default=None,
        metavar="{local,pause,full}",
        help="What each engine enforces while the store is unreachable (N: the engines it "
        "last counted, or --outrate-store-engines if it never reached the store; B: the "
        "bound (W + burst) x rate + 1 of one engine). "
        "local (default): rate/N on each engine, at most each user's last share, for as "
        "long as the outage lasts; users see tokens at rate/N on each engine; across "
        "engines at most B + N while every engine is cut off, at most (1 + 1/N) x rate "
        "while one is cut off past the hold. "
        "pause: the same for the hold, then limited users get no tokens (held, never cut) "
        "until the store answers, and at once on an engine that never reached it; at most "
        "B + N in every fault (a user with a peak still borrows up to peak - rate on each "
        "engine: borrowing is local). "
        "full: the full rate on each engine; up to N x rate in total. "
        "('share' is the old name of pause.) A store that refuses the engine at start (a "
        "wrong password) stops the start, unless full.",
    )
    group.add_argument(
        "--outrate-store-hold-s",
        **typed("--outrate-store-hold-s"),
        default=None,
        metavar="S",
        help="How long the other engines keep the part of an engine that stopped "
        "heartbeating (and, with pause, how long it serves before its limited users wait): "
        "default 30. Use the same value on every engine (a mismatch is logged and reported).",
    )
    group.add_argument(
        "--outrate-store-engines",
        **typed("--outrate-store-engines"),
        default=None,
        metavar="N",
        help="Engines expected to share the store: what an engine that starts while the "
        "store is unreachable divides each rate by (default: --data-parallel-size, else 1).",
    )
    group.add_argument(
        "--outrate-store-lease-ms",
        **typed("--outrate-store-lease-ms"),
        default=None,
        metavar="MS",
        help="Lease interval: one round trip to the store per MS per engine (default 20).",
    )
    group.add_argument(
        "--outrate-quota-file",
        default=None,
        metavar="PATH",
        help="Where the policy's token quotas (quota:) keep each user's usage across "
        "restarts: the engine saves it there every second and loads it at start; the API "
        "server reads it to refuse (429) a user whose quota is spent. Needed by a policy "
        "with a quota.",
    )
    group.add_argument(
        "--default-user-output-tokens-per-second",
        **typed("--default-user-output-tokens-per-second"),
        default=None,
        metavar="N",
        help="In-memory policy: rate for every user not listed (tokens/s).",
    )
    group.add_argument(
        "--user-output-tokens-per-second",
        default=None,
        metavar="JSON",
        help="In-memory policy: per-user rates, e.g. '{\"user-a\": 100}'.",
    )


def apply_outrate_args(engine_args: Any, args: argparse.Namespace) -> Any:
    """Turn the outrate flags into engine settings, or exit with the reason."""
    from outrate.errors import OutrateError
    from outrate.identity.core import SECRET_ENV
    from vllm_integration.common.config import (
        SCHEDULER_CLS,
        check_deployment,
        check_exposure,
        compile_settings,
        deployment_from_engine_args,
        exposure_from_args,
        outrate_settings,
        refuse_prompt_limits,
        refuse_quotas,
    )
    from vllm_integration.common.settings import CONFIG_KEY

    try:
        settings = outrate_settings(args)
        if settings is None:
            return engine_args
        exposure = exposure_from_args(args)
        settings = settings.replace(
            vllm_api_key=exposure is not None and exposure.api_key,
            data_parallel_size=engine_args.data_parallel_size or 1,
        )
        policy = compile_settings(settings)
        deployment = deployment_from_engine_args(engine_args, settings)
        findings = check_deployment(deployment)
        refuse_prompt_limits(
            policy, deployment.store, deployment.chunked_prefill, deployment.max_model_len
        )
        refuse_quotas(
            policy, deployment.store, settings.quota_file, settings.data_parallel_size or 1
        )
        for finding in findings + check_exposure(policy.identity, exposure):
            logger.warning("outrate: %s", finding)
    except OutrateError as exc:
        raise SystemExit(f"outrate: {exc}") from exc
    engine_args.scheduler_cls = SCHEDULER_CLS
    from vllm_integration.apiserver.guards import GUARD_MIDDLEWARE, install_request_guards
    from vllm_integration.apiserver.identity import configure_gate
    from vllm_integration.apiserver.metrics import install_metrics

    # The API server signs the identity it resolved; the engine core (started
    # after this, inheriting the environment) verifies it. Per start, never logged.
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))
    configure_gate(settings, policy)

    settings = settings.replace(metrics_dir=install_metrics())
    engine_args.additional_config = {
        **(engine_args.additional_config or {}),
        CONFIG_KEY: settings.to_config(),
    }
    install_request_guards()
    middleware = getattr(args, "middleware", None)  # only `vllm serve` has it
    if isinstance(middleware, list) and GUARD_MIDDLEWARE not in middleware:
        args.middleware = [*middleware, GUARD_MIDDLEWARE]  # a new list: argparse shares defaults
    logger.info("outrate: %s", policy.summary())
    return engine_args
