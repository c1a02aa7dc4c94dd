"""From vLLM's configuration to outrate's: flags, the policy, the deployment.

The settings travel from the API server to the engine-core process as an
`EngineSettings` record (settings.py) in `VllmConfig.additional_config`.
Both sides run the same checks: the API server to
fail fast with a readable message, the engine on the final config.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from outrate.budget.shared.credit import fallback_named
from outrate.budget.shared.lease import PASSWORD_ENV, split_password
from outrate.budget.shared.url import SSL_PASSWORD_ENV, split_ssl_password
from outrate.check.deployment import Deployment
from outrate.check.outrate_flags import (
    FLAGS,
    POLICY,
    QUOTA_FILE,
    RELOAD,
    STORE,
    STORE_ENGINES,
    STORE_FALLBACK,
    STORE_HOLD_S,
    STORE_LEASE_MS,
    TRACE,
    TRACE_MAX_BYTES,
    check_flags,
    given,
)
from outrate.check.prompts import prompt_refusals
from outrate.check.quotas import quota_refusals
from outrate.check.rules import API_KEY_CONFLICT, Finding, lint_deployment, lint_exposure
from outrate.errors import OutrateError, PolicyError, Problem
from outrate.identity.core import IdentityConfig
from outrate.policy.compiler import CompiledPolicy
from outrate.policy.pipeline import DEFAULT_FLAG, USERS_FLAG, load_compiled, policy_from_flags
from vllm_integration.common.settings import CONFIG_KEY, EngineSettings

logger = logging.getLogger("vllm.outrate")

SCHEDULER_CLS = "vllm_integration.enginecore.outrate_scheduler"


class DeploymentRejected(OutrateError):
    """The vLLM deployment cannot enforce a policy; the message says why.
    (Not `outrate.check.deployment.DeploymentError`: that one is a description that
    cannot be read.)"""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = findings
        lines = "\n  ".join(map(str, findings))
        super().__init__(f"outrate cannot run under this vLLM configuration:\n  {lines}")


def outrate_settings(args: Any) -> EngineSettings | None:
    """The outrate part of parsed `vllm serve` args, or None without a policy.

    Every `--outrate-*` flag is checked by `outrate.check.outrate_flags.check_flags`,
    the checks `outrate lint` runs on the same flags."""
    values = {flag.name: getattr(args, flag.dest, None) for flag in FLAGS}
    if not any(given(values[name]) for name in (POLICY, DEFAULT_FLAG, USERS_FLAG)):
        return None
    kept = check_flags(values, getattr(args, "data_parallel_size", 1) or 1)
    settings: dict[str, Any] = {"reload": kept[RELOAD] or "watch"}
    settings.update(store_settings(kept))
    if given(kept[TRACE]):
        settings["trace"] = kept[TRACE]
        if kept[TRACE_MAX_BYTES] is not None:
            settings["trace_max_bytes"] = kept[TRACE_MAX_BYTES]
    if given(kept[QUOTA_FILE]):
        settings["quota_file"] = kept[QUOTA_FILE]
    if given(kept[POLICY]):
        settings["policy"] = os.path.abspath(kept[POLICY])
    else:
        users = kept[USERS_FLAG]
        settings["default_rate"] = kept[DEFAULT_FLAG]
        settings["user_rates"] = users if users is None or isinstance(users, dict) else str(users)
    return EngineSettings(**settings)


def store_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """`--outrate-store` and friends, already checked (`check_flags`). The
    URL's password (and its TLS key's `ssl_password`) never goes into the
    settings (they travel inside vLLM's config, which vLLM hashes and may
    print): each moves to the environment variable the engine core inherits."""
    url = values.get(STORE)
    if not url:
        return {}
    fallback, deprecated = fallback_named(values.get(STORE_FALLBACK))
    if deprecated:
        logger.warning("outrate: %s", deprecated)
    bare, password = split_password(url)
    if password is not None:
        os.environ[PASSWORD_ENV] = password  # inherited by the engine-core process
    bare, ssl_password = split_ssl_password(bare)
    if ssl_password is not None:
        os.environ[SSL_PASSWORD_ENV] = ssl_password  # (the same way)
    out: dict[str, Any] = {"store": bare, "store_fallback": fallback}
    for name, key in (
        (STORE_LEASE_MS, "store_lease_ms"),
        (STORE_HOLD_S, "store_hold_s"),
        (STORE_ENGINES, "store_engines"),
    ):
        if values.get(name) is not None:
            out[key] = values[name]
    if "store_hold_s" in out:
        out["store_hold_s"] = float(out["store_hold_s"])
    return out


def compile_settings(settings: EngineSettings) -> CompiledPolicy:
    """Load and compile the policy the settings name. Raises PolicyError."""
    if settings.policy is not None:
        return load_checked(settings.policy, settings.vllm_api_key)
    return policy_from_flags(settings.default_rate, settings.user_rates)


def load_checked(path: str | os.PathLike[str], vllm_api_key: bool = False) -> CompiledPolicy:
    """`load_compiled`, refusing what this server cannot do: api_key identity
    beside vLLM's own --api-key (OR114). What startup and both reloaders (engine
    core, API server) load, so they accept and refuse the same edits."""
    policy = load_compiled(path)
    if vllm_api_key and policy.identity.source == "api_key":
        where = policy.policy.position("identity", "source") if policy.policy else None
        line, col = where or (1, 1)
        problem = Problem(policy.source, line, col, "identity.source", API_KEY_CONFLICT)
        raise PolicyError([problem], depends_on=policy.depends_on)
    return policy


def refuse_prompt_limits(
    policy: CompiledPolicy, store: bool, chunked: bool | None, max_model_len: int | None
) -> CompiledPolicy:
    """The prompt limits this engine cannot enforce, refused with lint's
    located messages (outrate/check/prompts.py): OR119 with `--outrate-store`,
    OR118 without chunked prefill. At start (the API server with what its
    flags say, the engine core with its final config) and on reload (the
    engine core's loader: the edit is rejected, the old policy kept).
    Returns `policy`."""
    refused = prompt_refusals(policy, store, chunked, max_model_len)
    if refused:
        raise PolicyError([p for _, p in refused], depends_on=policy.depends_on)
    return policy


def refuse_quotas(
    policy: CompiledPolicy, store: bool, quota_file: str | None, data_parallel: int = 1
) -> CompiledPolicy:
    """The quotas this deployment cannot keep, refused with lint's located
    messages (outrate/check/quotas.py): OR121 without a file to keep usage
    in, OR122 beside a shared store with data parallel (not built). At start
    in both processes and on reload (the edit is rejected). Returns `policy`."""
    refused = quota_refusals(policy, store, quota_file, data_parallel)
    if refused:
        raise PolicyError([p for _, p in refused], depends_on=policy.depends_on)
    return policy


def _model_len(value: Any) -> int | None:
    """vLLM's `max_model_len` as asked for: None when it comes from the model."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def exposure_from_args(args: Any) -> Deployment | None:
    """Who can reach the server and whether vLLM checks keys itself, from
    `vllm serve`'s parsed flags (None elsewhere: nothing is served over HTTP).
    Keys are never kept, only whether there are any."""
    if not hasattr(args, "host"):
        return None
    tokens = [k for k in (getattr(args, "api_key", None) or []) if k]
    env_key = not tokens and bool(os.environ.get("VLLM_API_KEY"))
    where = {"host": "--host", "api_key": "VLLM_API_KEY" if env_key else "--api-key"}
    return Deployment(
        host=getattr(args, "host", None),
        uds=getattr(args, "uds", None),
        api_key=bool(tokens) or env_key,
        source="vllm serve arguments",
        locations=MappingProxyType(where),
    )


def check_exposure(identity: IdentityConfig, dep: Deployment | None) -> list[Finding]:
    """Raise DeploymentRejected on errors (OR114); return the warnings (OR113)."""
    if dep is None:
        return []
    findings = lint_exposure(identity, dep)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise DeploymentRejected(errors)
    return findings


def settings_from_vllm_config(vllm_config: Any) -> EngineSettings:
    """In the engine core: the settings the API server sent. Runs the
    deployment rules on the final config first; raises on any error."""
    raw = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    if not raw:
        raise OutrateError(
            "the outrate scheduler was selected but no policy was given: "
            "start vLLM with --outrate-policy PATH"
        )
    settings = EngineSettings.from_config(raw)
    check_deployment(deployment_from_vllm_config(vllm_config, settings))
    return settings


_CONNECTORS = (
    ("connector", "a KV connector"),
    ("ec_connector", "an EC connector"),
    ("aux_output_connector", "an aux output connector"),
)


def refuse_connectors(scheduler: Any) -> None:
    """The engine's last check: connectors the scheduler was built with."""
    for attr, what in _CONNECTORS:
        if getattr(scheduler, attr, None) is not None:
            raise OutrateError(
                f"outrate cannot run with {what}: its tokens and KV move outside "
                "the scheduler decisions the per-user limiter makes"
            )


def check_deployment(dep: Deployment) -> list[Finding]:
    """Raise DeploymentRejected on errors; return the warnings."""
    findings = lint_deployment(dep)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise DeploymentRejected(errors)
    return findings


def _connector(cfg: Any) -> str | None:
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        return cfg.get("kv_connector") or cfg.get("ec_connector") or "configured"
    return getattr(cfg, "kv_connector", None) or getattr(cfg, "ec_connector", None) or "configured"


def _aux_output(cfg: Any, engine_args: Any) -> bool:
    if getattr(engine_args, "enable_return_routed_experts", False):
        return True
    if isinstance(cfg, dict):
        return bool(cfg.get("enable_return_routed_experts"))
    return bool(getattr(cfg, "enable_return_routed_experts", False))


def _scheduler_cls(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return f"{value.__module__}.{value.__qualname__}"


def deployment_from_engine_args(ea: Any, settings: EngineSettings | None = None) -> Deployment:
    """API-server side: the deployment as the user asked for it."""
    store = settings is not None and bool(settings.store)
    return Deployment(
        store=store,
        store_fallback=settings.store_fallback if settings is not None and store else None,
        store_engines=settings.store_engines if settings is not None else None,
        store_hold_s=settings.store_hold_s if settings is not None else None,
        speculative=bool(ea.speculative_config),
        data_parallel_size=ea.data_parallel_size or 1,
        pipeline_parallel_size=ea.pipeline_parallel_size or 1,
        tensor_parallel_size=ea.tensor_parallel_size or 1,
        kv_connector=_connector(ea.kv_transfer_config),
        ec_connector=_connector(ea.ec_transfer_config),
        kv_offload=ea.kv_offloading_size is not None,
        aux_output=_aux_output(ea.aux_output_config, ea),
        scheduler_cls=_scheduler_cls(ea.scheduler_cls),
        max_num_seqs=ea.max_num_seqs,
        max_num_active_seqs=ea.max_num_active_seqs,
        chunked_prefill=ea.enable_chunked_prefill,
        max_model_len=_model_len(ea.max_model_len),
        async_scheduling=ea.async_scheduling,
        source="vllm serve arguments",
    )


def _model_kind(mc: Any) -> str | None:
    checks = (
        ("is_diffusion", "diffusion"),
        ("is_encoder_decoder", "encoder-decoder"),
        ("is_multimodal_model", "multimodal"),
        ("is_hybrid", "hybrid"),
        ("is_attention_free", "attention-free"),
    )
    for attr, kind in checks:
        try:
            if getattr(mc, attr):
                return kind
        except Exception:  # a property that cannot answer for this model
            continue
    return None


def deployment_from_vllm_config(vc: Any, settings: EngineSettings | None = None) -> Deployment:
    """Engine side: the deployment as vLLM finally configured it."""
    pc, sc, cc = vc.parallel_config, vc.scheduler_config, vc.cache_config
    settings = settings or EngineSettings()
    return Deployment(
        store=bool(settings.store),
        store_fallback=settings.store_fallback if settings.store else None,
        store_engines=settings.store_engines,
        store_hold_s=settings.store_hold_s,
        speculative=vc.speculative_config is not None,
        # vLLM resets it to 1 in each non-MoE data-parallel engine core; the
        # plugin recorded the size asked for.
        data_parallel_size=max(pc.data_parallel_size, settings.data_parallel_size),
        pipeline_parallel_size=pc.pipeline_parallel_size,
        tensor_parallel_size=pc.tensor_parallel_size,
        kv_connector=_connector(vc.kv_transfer_config),
        ec_connector=_connector(getattr(vc, "ec_transfer_config", None)),
        kv_offload=getattr(cc, "kv_offloading_size", None) is not None,
        aux_output=_aux_output(getattr(vc, "aux_output_config", None), None),
        scheduler_cls=_scheduler_cls(sc.scheduler_cls),
        max_num_seqs=sc.max_num_seqs,
        max_num_active_seqs=sc.max_num_active_seqs,
        chunked_prefill=sc.enable_chunked_prefill,
        max_model_len=vc.model_config.max_model_len,
        async_scheduling=sc.async_scheduling,
        model_kind=_model_kind(vc.model_config),
        source="vLLM engine config",
    )
