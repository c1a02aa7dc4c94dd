"""The deployment rules: what a vLLM deployment must not be for a per-user
limit to hold (errors), or to serve users as well as it could (warnings); and
the exposure rules, over the policy's identity section and who can reach the
server. Each rule is a row of a table: a new rule is a new row. The codes are
listed in lint.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

from outrate.check.deployment import Deployment
from outrate.identity.core import IdentityConfig

Severity = Literal["error", "warning"]

OFFLOAD_CONNECTORS = frozenset(
    {"OffloadingConnector", "SimpleCPUOffloadConnector", "LMCacheMPConnector"}
)
"""Connectors vLLM 0.32 installs itself for --kv-offloading-size (reported as OR106)."""

REJECTED_MODEL_KINDS = {
    "multimodal": "encoder inputs are scheduled under a separate encoder budget that "
    "the per-user limiter does not see",
    "encoder-decoder": "encoder steps are scheduled outside the decoder path the limiter charges",
    "hybrid": "hybrid (attention + state-space) models keep per-request state whose "
    "preemption and caching outrate's scheduler does not handle",
    "attention-free": "state-space models keep per-request state whose preemption "
    "and caching outrate's scheduler does not handle",
    "diffusion": "diffusion language models produce a canvas of tokens per step, "
    "so charging one token per sampling step would not match what users receive",
}


class Finding(NamedTuple):
    """One lint result. `location` is `path:line:col`, a flag, or a source name."""

    code: str
    severity: Severity
    message: str
    location: str

    def __str__(self) -> str:
        return f"{self.location}: {self.code} {self.severity}: {self.message}"


def is_outrate_scheduler(name: str | None) -> bool:
    """None lets the outrate plugin pick its scheduler; anything else must be ours."""
    return name is None or "vllm_integration" in name or "outrate" in name


class DeploymentRule(NamedTuple):
    """One row of the deployment rules: a new rule is a new row."""

    code: str
    severity: Literal["error", "warning"]
    field: str
    applies: Callable[[Deployment], bool]
    message: Callable[[Deployment], str]


def _kv_connector_rejected(dep: Deployment) -> bool:
    return dep.kv_connector is not None and not (
        dep.kv_offload and dep.kv_connector in OFFLOAD_CONNECTORS
    )


DEPLOYMENT_RULES: tuple[DeploymentRule, ...] = (
    DeploymentRule(
        "OR101",
        "error",
        "speculative",
        lambda d: d.speculative,
        lambda d: (
            "speculative decoding is not supported: draft tokens are sampled without "
            "passing the per-user limiter"
        ),
    ),
    DeploymentRule(
        "OR102",
        "error",
        "data_parallel_size",
        lambda d: d.data_parallel_size > 1 and not d.store,
        lambda d: (
            f"data parallel size {d.data_parallel_size} needs a shared budget store: each "
            "data-parallel engine keeps its own budgets, so a user would get up to "
            f"{d.data_parallel_size} times its rate; pass --outrate-store redis://HOST:PORT/DB"
        ),
    ),
    DeploymentRule(
        "OR103",
        "error",
        "pipeline_parallel_size",
        lambda d: d.pipeline_parallel_size > 1,
        lambda d: (
            f"pipeline parallel size {d.pipeline_parallel_size} is not supported: "
            "several batches are in flight at once through vLLM's batch queue, which "
            "outrate's charge-at-dispatch and refund points do not cover"
        ),
    ),
    DeploymentRule(
        "OR104",
        "error",
        "kv_connector",
        _kv_connector_rejected,
        lambda d: (
            f"KV connector '{d.kv_connector}' is not supported: requests waiting for "
            "remote or loaded KV are scheduled through connector states outrate's "
            "scheduler does not charge, and disaggregated engines would each enforce "
            "their own budget"
        ),
    ),
    DeploymentRule(
        "OR105",
        "error",
        "ec_connector",
        lambda d: d.ec_connector is not None,
        lambda d: (
            f"EC connector '{d.ec_connector}' is not supported: it moves encoder "
            "(multimodal) outputs between engines, and multimodal models are not "
            "supported"
        ),
    ),
    DeploymentRule(
        "OR106",
        "error",
        "kv_offload",
        lambda d: d.kv_offload,
        lambda d: (
            "KV offloading is not supported: vLLM implements it as a KV connector "
            "(OffloadingConnector), and throttled requests keep their KV on the GPU "
            "by design, which offloading would undo behind the limiter's back"
        ),
    ),
    DeploymentRule(
        "OR107",
        "error",
        "aux_output",
        lambda d: d.aux_output,
        lambda d: (
            "auxiliary outputs (routed experts) are not supported: they travel through "
            "a scheduler-side aux-output connector that outrate's scheduler does not "
            "drive for throttled, skipped requests"
        ),
    ),
    DeploymentRule(
        "OR108",
        "error",
        "scheduler_cls",
        lambda d: not is_outrate_scheduler(d.scheduler_cls),
        lambda d: (
            f"scheduler class '{d.scheduler_cls}' is not outrate's: limits are "
            "enforced inside outrate's scheduler, so with another one nothing would "
            "be limited; remove --scheduler-cls and let the outrate plugin choose"
        ),
    ),
    DeploymentRule(
        "OR109",
        "error",
        "model_kind",
        lambda d: d.model_kind in REJECTED_MODEL_KINDS,
        lambda d: (
            f"{d.model_kind} models are not supported: {REJECTED_MODEL_KINDS[d.model_kind or '']}"
        ),
    ),
    DeploymentRule(
        "OR112",
        "warning",
        "chunked_prefill",
        lambda d: d.chunked_prefill is False,
        lambda d: (
            "chunked prefill is disabled: a throttled user's prompt cannot prefill "
            "ahead while it waits for budget, so its whole prefill runs after the "
            "wait and adds to its time to first token"
        ),
    ),
    DeploymentRule(
        "OR115",
        "warning",
        "store_fallback",
        lambda d: bool(d.store) and d.store_fallback == "full",
        lambda d: (
            "--outrate-store-fallback full: while the budget store is unreachable every "
            "engine enforces each user's full rate, so with N engines a user may get up "
            "to N times its rate; the default 'local' enforces rate/N on each"
        ),
    ),
    DeploymentRule(
        "OR116",
        "warning",
        "store",
        lambda d: (
            bool(d.store)
            and d.store_fallback != "full"
            and d.store_fallback not in ("pause", "share")
            and d.store_engines is None
            and d.data_parallel_size <= 1
        ),
        lambda d: (
            "--outrate-store without --outrate-store-engines: an engine that starts while "
            "the store is unreachable does not know how many engines share it, so it "
            "enforces each user's full rate (N = 1) until the store answers; K replicas "
            "started during an outage may give a user up to K times its rate. Pass "
            "--outrate-store-engines K (the engines expected to share the store)"
        ),
    ),
    DeploymentRule(
        "OR117",
        "warning",
        "store_fallback",
        lambda d: bool(d.store) and d.store_fallback == "share",
        lambda d: (
            "--outrate-store-fallback share is the old name of 'pause': limited users get "
            "no tokens once an outage outlasts the hold (--outrate-store-hold-s, 30 s by "
            "default), and none on an engine that starts while the store is unreachable. "
            "Write 'pause' to keep that; the default, 'local', keeps serving them at rate/N "
            "for the whole outage"
        ),
    ),
)


def lint_deployment(dep: Deployment) -> list[Finding]:
    """Errors: configurations where the per-user limit cannot hold. Warnings:
    configurations where it holds but serves users worse than it could. The
    rules are rows of DEPLOYMENT_RULES, plus the OR111 slot check."""
    out = [
        Finding(rule.code, rule.severity, rule.message(dep), dep.where(rule.field))
        for rule in DEPLOYMENT_RULES
        if rule.code < "OR110" and rule.applies(dep)
    ]
    out += _active_seqs(dep)
    out += [
        Finding(rule.code, rule.severity, rule.message(dep), dep.where(rule.field))
        for rule in DEPLOYMENT_RULES
        if rule.code > "OR111" and rule.applies(dep)
    ]
    return out


class ExposureRule(NamedTuple):
    """A rule over the policy's identity section and the deployment together."""

    code: str
    severity: Literal["error", "warning"]
    field: str
    applies: Callable[[IdentityConfig, Deployment], bool]
    message: Callable[[IdentityConfig, Deployment], str]


API_KEY_CONFLICT = (
    "identity.source api_key cannot run beside vLLM's own --api-key (or VLLM_API_KEY): "
    "both read the one Authorization header, so every request would need a key "
    "listed in both; remove --api-key and let outrate's keys file authenticate "
    "(it guards every route but /health, /ping, /metrics and /v1/models)"
)

EXPOSURE_RULES: tuple[ExposureRule, ...] = (
    ExposureRule(
        "OR113",
        "warning",
        "host",
        lambda i, d: i.source == "body" and not d.loopback_only,
        lambda i, d: (
            f"identity.source is body and vLLM listens on {d.listening_on()}: any client "
            "that reaches the port can name any user in vllm_xargs.output_rate_user and "
            "spend that user's budget; use 'source: api_key', or 'source: header' behind "
            "a gateway that sets it, or bind to 127.0.0.1"
        ),
    ),
    ExposureRule(
        "OR114",
        "error",
        "api_key",
        lambda i, d: i.source == "api_key" and d.api_key,
        lambda i, d: API_KEY_CONFLICT,
    ),
)


def lint_exposure(identity: IdentityConfig, dep: Deployment) -> list[Finding]:
    """Who can reach the server against whom the policy trusts."""
    return [
        Finding(rule.code, rule.severity, rule.message(identity, dep), dep.where(rule.field))
        for rule in EXPOSURE_RULES
        if rule.applies(identity, dep)
    ]


def _active_seqs(dep: Deployment) -> list[Finding]:
    why = (
        "throttled requests keep their running slot, so only a cap below "
        "--max-num-seqs leaves them room to yield their turn to unthrottled requests"
    )
    seqs = "the vLLM default" if dep.max_num_seqs is None else str(dep.max_num_seqs)
    hint = f" (e.g. {dep.max_num_seqs * 3 // 4})" if dep.max_num_seqs else ""
    if dep.max_num_active_seqs is None:
        message = (
            f"--max-num-active-seqs is not set: {why}; set it below --max-num-seqs ({seqs}){hint}"
        )
    elif dep.max_num_seqs is not None and dep.max_num_active_seqs >= dep.max_num_seqs:
        message = (
            f"--max-num-active-seqs {dep.max_num_active_seqs} is not below "
            f"--max-num-seqs {dep.max_num_seqs}: {why}{hint}"
        )
    else:
        return []
    return [Finding("OR111", "warning", message, dep.where("max_num_active_seqs"))]
