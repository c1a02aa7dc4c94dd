"""The identity configuration in the API server process, hot-reloaded there.

Why the API server keeps its own copy: identity is decided per HTTP request,
in the API server (the middleware in api.py), while the policy reloader runs
in the engine-core process, a different process with no channel back. So
each API server process runs a second `Reloader` on the same policy file and
the same keys file, with the same loader (`config.load_checked`): both
processes accept and refuse exactly the same edits, a revocation applies in
the API server within the debounce (~150 ms) without waiting on the engine,
and a wedged engine cannot delay it. The price: an edit is parsed twice (once
per process). The engine needs the identity section only to know whether to
trust a body field; the API server's signature (`Stamper`) carries the rest.

How the settings reach the process: `apply_outrate_args` (startup/plugin.py) runs in
the process that parses `vllm serve`'s flags; it hands over the policy it
validated (`configure_gate`) and writes the same settings to `SETTINGS_ENV`,
so API server processes vLLM spawns (`--api-server-count > 1`) build their
own gate from the environment they inherit, as they build the middleware.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from outrate.contract.quotas import QuotaView
from outrate.contract.requests import RequestTable
from outrate.env import API_SETTINGS, Env
from outrate.errors import OutrateError
from outrate.identity.core import BODY, SECRET_ENV, IdentityConfig, Stamper
from outrate.policy.compiler import CompiledPolicy
from outrate.policy.reload import Reloader
from vllm_integration.common.settings import EngineSettings

if TYPE_CHECKING:
    from outrate.budget.shared.runner import LeaseRunner


def has_request_rates(policy: CompiledPolicy) -> bool:
    """Some rule has a request rate (enforced or in shadow)."""
    return any(
        lim.requests is not None and lim.requests.rate is not None for lim in policy.all_limits()
    )


SETTINGS_ENV = API_SETTINGS
"""JSON: {"policy": path or null, "reload": mode, "vllm_api_key": bool}."""

logger = logging.getLogger("vllm.outrate.identity")


class Gate:
    """What the middleware and the engine-client patch read per request:
    `identity` and `policy`, each replaced whole by the reloader thread, and
    the request-rate table (`requests`), which only the event loop touches."""

    def __init__(
        self,
        identity: IdentityConfig = BODY,
        stamper: Stamper | None = None,
        reloader: Reloader | None = None,
        policy: CompiledPolicy | None = None,
    ) -> None:
        self.identity = identity
        self.stamper = stamper
        self.reloader = reloader
        self.policy = policy
        """The limits a request is admitted under (request rate, headers);
        None: no policy in this process (no rate-limit headers)."""
        self.requests = RequestTable()
        self.lease: LeaseRunner | None = None
        """With --outrate-store: the lease thread of `requests`' shared budget."""
        self.store: dict[str, Any] | None = None
        """The store settings handed over (`share_requests`), None without one."""
        self.quotas: QuotaView | None = None
        """With --outrate-quota-file: the usage the engine saves (quota refusals)."""

    def share_requests(self, policy: CompiledPolicy) -> None:
        """With a store, once some rule has a request rate: lease request
        credit with the other API servers (vllm_integration/apiserver/store.py).
        Not before: an API server with no request rate to share keeps no
        lease thread (nor its log lines). A reload that adds the first rate
        starts it (its table starts fresh: one burst, once)."""
        if self.store is None or self.lease is not None or not has_request_rates(policy):
            return
        from vllm_integration.apiserver.store import open_requests

        self.requests, self.lease = open_requests(
            self.store, policy, lambda: (self.policy or policy).sha256
        )

    def publish(self, policy: CompiledPolicy) -> None:
        self.share_requests(policy)
        self.policy = policy
        old, self.identity = self.identity, policy.identity
        if old != policy.identity:
            logger.info("outrate: identity %s", policy.identity.describe())
        elif old.keys != policy.identity.keys:
            logger.info("outrate: identity keys reloaded: %s", policy.identity.describe())

    def stop(self) -> None:
        if self.reloader is not None:
            self.reloader.stop()
        if self.lease is not None:
            self.lease.stop()


_gate: Gate | None = None
_handed_over: tuple[dict[str, Any], CompiledPolicy] | None = None
_lock = threading.Lock()


def configure_gate(settings: EngineSettings, policy: CompiledPolicy) -> None:
    """In the process that parsed the flags: the settings and the policy it
    validated, for this process's gate and (via the environment) others'."""
    global _handed_over, _gate
    api = {
        "policy": settings.policy,
        "reload": settings.reload,
        "vllm_api_key": settings.vllm_api_key,
        "quota_file": settings.quota_file,
        "store": settings.store,
        "store_fallback": settings.store_fallback,
        "store_lease_ms": settings.store_lease_ms,
        "store_hold_s": settings.store_hold_s,
        # what an API server that never reached the store divides by
        "store_api_servers": settings.store_engines or settings.data_parallel_size or 1,
    }
    os.environ[SETTINGS_ENV] = json.dumps(api)
    with _lock:
        if _gate is not None:
            _gate.stop()
        _gate = None
        _handed_over = (api, policy)


def gate() -> Gate:
    """This process's gate, built on first use (the middleware's construction,
    at app startup). Without outrate settings: the body, as before."""
    global _gate
    with _lock:
        if _gate is None:
            _gate = _build()
        return _gate


def _build() -> Gate:
    from vllm_integration.common.config import load_checked

    stamper = Stamper.from_env()
    if _handed_over is not None:
        api, policy = _handed_over
    else:
        raw = Env.read().api_settings
        if not raw:
            return Gate(BODY, stamper)
        api = json.loads(raw)
        policy = None
    path = api.get("policy")
    if path is None:  # the seed's in-memory flags: no file, no identity section
        return Gate(BODY, stamper, policy=policy)
    vllm_api_key = bool(api.get("vllm_api_key"))
    if policy is None:
        try:
            policy = load_checked(path, vllm_api_key)
        except OutrateError as e:
            raise SystemExit(f"outrate: {e}") from e
    g = Gate(policy.identity, stamper, policy=policy)
    if api.get("store"):
        g.store = api
        g.share_requests(policy)
    if api.get("quota_file"):
        g.quotas = QuotaView(api["quota_file"])
    if policy.identity.source != "body" and stamper is None:
        logger.warning(
            "outrate: %s is not set in this process (or is not hex of at least 16 bytes): "
            "the engine will count every request as anonymous (identity.source is %s)",
            SECRET_ENV,
            policy.identity.source,
        )
    if api.get("reload", "watch") != "off":
        g.reloader = Reloader(
            path,
            g.publish,
            initial=policy,
            mode=api["reload"],
            logger=logger,
            loader=lambda p: load_checked(p, vllm_api_key),
            log=False,  # the engine core's reloader logs each edit; this one counts
        )
        g.reloader.start()
    if policy.identity.source != "body":
        logger.info("outrate: identity %s", policy.identity.describe())
    return g


def reset_gate() -> None:
    """Tests: forget this process's gate and any hand-over."""
    global _gate, _handed_over
    with _lock:
        if _gate is not None:
            _gate.stop()
        _gate = None
        _handed_over = None
