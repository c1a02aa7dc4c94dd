"""API-server guards: who is asking (401/403), bad identities and beam search (400),
requests over their user's rate (429), and the rate-limit header fields.

Identity (one rule set, `outrate.identity.core` and `outrate.identity.gate`, on every route):

- `IdentityGuard`, an ASGI middleware (vLLM's documented `--middleware`
  hook, added by the plugin; the outermost layer, before vLLM's own
  `--api-key` check), decides once per request with the policy's `identity:`
  section as this process's gate holds it (vllm_integration/apiserver/identity.py):
  with `api_key`, no valid `Authorization: Bearer KEY` is 401; with
  `header`, the gateway's header names the user; a JSON body whose
  `vllm_xargs.output_rate_user` (or `sampling_params.extra_args.
  output_rate_user` on `/inference/v1/generate`) is invalid is 400, and one
  naming another user is 403 with `on_claim_mismatch: reject`. Refusals are
  in vLLM's error format (Anthropic's on `/v1/messages`), before any route
  runs, so no route can start a 200 stream first or log a traceback. Every
  route but /health, /ping, /metrics and /v1/models is guarded, including
  routes vLLM adds later. The decision is kept in a context variable for the
  rest of the request. Then, with a policy in this process, the request rate
  (`requests:`; outrate.contract.requests): one request of the user's bucket,
  429 with Retry-After when it does not conform, before any route parses,
  tokenizes or queues it; and every response that goes on gets the limits in
  force at this admission as header fields (outrate.contract.headers).
- `AsyncLLM.add_request` (patched in the API server), the one door of every
  route to the engine, carries the decision to the engine: the user goes into
  `extra_args` with the API server's signature (`identity.STAMP_KEY`), and
  whatever the client wrote there is replaced. It also refuses what slipped
  past the middleware: an invalid identity (a form body, say: 400), a claim
  of another user (403), and, with `api_key`, a request that did not come
  through the middleware at all (401: fail closed).
- The engine, with a source other than body, trusts only a valid signature
  (`resolve_identity`); with body it maps an invalid identity to the
  anonymous budget: the last line, never the first.

Beam search: `to_beam_search_params` of vLLM 0.32's OpenAI request models is
patched to refuse it: each beam is sampled by the API server's own loop of
engine requests, whose tokens the per-user limiter cannot attribute to one
stream. Installed only in the API server, only when a policy is active.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any, NamedTuple

from outrate.budget.gcra import NS_PER_S
from outrate.budget.quota import QuotaLeft, Spent, spent_of
from outrate.contract.headers import (
    Header,
    limit_headers,
    refusal_headers,
    refusal_message,
)
from outrate.contract.quotas import quota_body
from outrate.contract.requests import Admission, admit_waiting
from outrate.identity.core import (
    ANONYMOUS,
    IDENTITY_FIELD,
    IDENTITY_KEY,
    STAMP_KEY,
    identity_error,
)
from outrate.identity.gate import (
    Claim,
    Verdict,
    authenticate,
    body_claims,
    check_claims,
    is_exempt,
)
from vllm_integration.apiserver.metrics import count_requests_over

GUARD_MIDDLEWARE = "vllm_integration.apiserver.guards.IdentityGuard"
"""What the plugin appends to `--middleware`."""

BEAM_SEARCH_MESSAGE = (
    "beam search is not supported while an outrate policy is active: beams are "
    "sampled outside the per-user output-token limiter"
)

_ANTHROPIC_PREFIX = "/v1/messages"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Resolved(NamedTuple):
    """The middleware's decision, for the engine-client patch."""

    source: str
    user: str | None  # with source body: unused (the request's own claim counts)
    on_claim_mismatch: str


RESOLVED: ContextVar[Resolved | None] = ContextVar("outrate_identity", default=None)
"""Set by `IdentityGuard` for the duration of one request; child tasks (a
streaming response, a background response) inherit it."""


class IdentityGuard:
    """ASGI middleware: the per-request identity decision, before any route."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        from vllm_integration.apiserver.identity import gate

        self.app = app
        self.gate = gate()
        install_request_guards()  # also in API server processes vLLM spawns

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        identity = self.gate.identity  # one read: a reload mid-request changes nothing
        method = scope.get("method")
        if is_exempt(method, _route_path(scope)):
            await self.app(scope, receive, send)
            return
        verdict = authenticate(identity, scope.get("headers", ()))
        if verdict.status != 200:
            await _refuse(scope, receive, send, verdict)
            return
        messages: list[Message] = []
        claims = []
        if kind == "http" and method == "POST" and _is_json(scope):
            while True:  # the whole body: the route would read all of it anyway
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
            body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
            claims = body_claims(body)
        verdict = check_claims(identity, verdict, claims)
        if verdict.status != 200:
            await _refuse(scope, receive, send, verdict)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        policy = self.gate.policy  # one read: the limits in force at admission
        if policy is not None and kind == "http":
            user = verdict.user if identity.source != "body" else _claimed(claims)
            key = ANONYMOUS if user is None else user
            rule = policy.limit_for(key)
            admission = await admit_waiting(self.gate.requests, policy, key)
            if admission.over:
                count_requests_over(admission.limit.label, "requests", admission.admitted)
            view = self.gate.quotas
            quotas = [] if view is None else view.state(rule, key)
            if not admission.admitted:
                await _too_many(scope, replay, send, policy.headers, rule, admission, quotas)
                return
            spent = spent_of(quotas)
            if spent is not None:
                count_requests_over(rule.label, "quota", False)
                await _quota_spent(
                    scope, replay, send, policy.headers, rule, admission, spent, quotas
                )
                return
            fields = limit_headers(policy.headers, rule, admission, quotas)
            if fields:
                send = _adding(send, fields)

        token = RESOLVED.set(Resolved(identity.source, verdict.user, identity.on_claim_mismatch))
        try:
            await self.app(scope, replay, send)
        finally:
            RESOLVED.reset(token)


def _claimed(claims: list[Claim]) -> str | None:
    """With source body, the user the engine will charge: the body's claim
    (check_claims made sure each is a valid identity); None: anonymous."""
    for _, value in claims:
        if isinstance(value, str):
            return value
    return None


def _adding(send: Send, fields: list[Header]) -> Send:
    """`send` with `fields` added to the response's head (streaming or not:
    the head goes first, so the values are those of the request's admission)."""

    async def send_with(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = [*message.get("headers", ()), *fields]
        await send(message)

    return send_with


async def _too_many(
    scope: Scope,
    receive: Receive,
    send: Send,
    style: str,
    rule: Any,
    admission: Admission,
    quotas: list[QuotaLeft],
) -> None:
    """429 over the user's request rate, with Retry-After and the limits."""
    body = {
        "error": {
            "message": refusal_message(admission),
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    await _send_429(scope, receive, send, body, refusal_headers(style, rule, admission, quotas))


async def _quota_spent(
    scope: Scope,
    receive: Receive,
    send: Send,
    style: str,
    rule: Any,
    admission: Admission,
    spent: Spent,
    quotas: list[QuotaLeft],
) -> None:
    """429 `insufficient_quota`, with Retry-After up to the spent window's reset."""
    refused = admission._replace(retry_after_ns=math.ceil(spent.reset_s * NS_PER_S))
    headers = refusal_headers(style, rule, refused, quotas)
    await _send_429(scope, receive, send, quota_body(spent), headers)


async def _send_429(
    scope: Scope,
    receive: Receive,
    send: Send,
    body: dict[str, Any],
    headers: list[tuple[bytes, bytes]],
) -> None:
    """A 429 with `body` in OpenAI's shape, or Anthropic's on `/v1/messages`
    (its message kept), and the header fields."""
    from starlette.responses import JSONResponse

    if str(scope.get("path", "")).startswith(_ANTHROPIC_PREFIX):
        message = body["error"]["message"]
        body = {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
    response = JSONResponse(body, status_code=HTTPStatus.TOO_MANY_REQUESTS)
    response.raw_headers += headers
    await response(scope, receive, send)


def _route_path(scope: Scope) -> str:
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "") or "")
    return path.removeprefix(root) if root else path


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return b"json" in value.lower()
    return False


async def _refuse(scope: Scope, receive: Receive, send: Send, verdict: Verdict) -> None:
    """The status in exactly the shape vLLM gives its own errors."""
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import GracefulHTTPError, VLLMValidationError

    if scope["type"] == "websocket":  # closing before accepting answers 403
        await send({"type": "websocket.close", "code": 1008, "reason": verdict.message[:120]})
        return
    if verdict.status == 400:
        error = create_error_response(
            VLLMValidationError(verdict.message, parameter=verdict.parameter)
        )
    else:
        error = create_error_response(
            GracefulHTTPError(verdict.message, HTTPStatus(verdict.status))
        )
    headers = {"WWW-Authenticate": "Bearer"} if verdict.status == 401 else None
    if str(scope.get("path", "")).startswith(_ANTHROPIC_PREFIX):
        from vllm.entrypoints.anthropic.api_router import translate_error_response

        response = translate_error_response(error)
        if headers:
            response.headers.update(headers)
    else:
        response = JSONResponse(error.model_dump(), status_code=error.error.code, headers=headers)
    await response(scope, receive, send)


def check_identity(request: Any) -> None:
    """Raise VLLMValidationError (HTTP 400) for a present but invalid identity."""
    from vllm.exceptions import VLLMValidationError

    xargs = getattr(request, "vllm_xargs", None)
    if not xargs or IDENTITY_KEY not in xargs:
        return
    error = identity_error(xargs[IDENTITY_KEY])
    if error is not None:
        raise VLLMValidationError(error, parameter=IDENTITY_FIELD)


def _check_params(prompt: Any, params: Any) -> None:
    from vllm.exceptions import VLLMValidationError

    params = getattr(prompt, "params", None) or params  # an EngineCoreRequest brings its own
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict) or IDENTITY_KEY not in extra:
        return
    error = identity_error(extra[IDENTITY_KEY])
    if error is not None:
        raise VLLMValidationError(error, parameter=IDENTITY_FIELD)


def stamp_params(prompt: Any, params: Any) -> None:
    """Write the identity this request resolved to into its sampling params,
    signed; drop whatever the client put under outrate's keys. Raises
    GracefulHTTPError (401, 403) for what the middleware could not see."""
    from vllm import SamplingParams
    from vllm.exceptions import GracefulHTTPError

    from vllm_integration.apiserver.identity import gate

    params = getattr(prompt, "params", None) or params
    if not isinstance(params, SamplingParams):
        return  # pooling: nothing is sampled, nothing is charged
    extra = dict(params.extra_args or {})
    claim = extra.pop(IDENTITY_KEY, None)
    extra.pop(STAMP_KEY, None)
    g = gate()
    resolved = RESOLVED.get()
    if resolved is None:  # not through the HTTP middleware (another frontend)
        source = g.identity.source
        if source == "api_key":
            raise GracefulHTTPError(
                "missing API key: this request did not come through outrate's HTTP guard",
                HTTPStatus.UNAUTHORIZED,
            )
        resolved = Resolved(source, None, g.identity.on_claim_mismatch)
    if resolved.source == "body":
        user = claim if isinstance(claim, str) else None
    else:
        user = resolved.user
        if claim is not None and claim != user and resolved.on_claim_mismatch == "reject":
            raise GracefulHTTPError(
                f"{IDENTITY_FIELD} names another user than this request's identity; leave it out",
                HTTPStatus.FORBIDDEN,
            )
    if user is not None:
        extra[IDENTITY_KEY] = user
        if g.stamper is not None:
            extra[STAMP_KEY] = g.stamper.sign(user)
    params.extra_args = extra or None


def install_engine_client_guard() -> None:
    """Patch `AsyncLLM.add_request` (vLLM 0.32), the one door of every route to
    the engine: an invalid identity is refused before the request is sent, and
    the identity the API server resolved is signed into it."""
    from vllm_integration.common.compat import owner_of

    AsyncLLM = owner_of("AsyncLLM.add_request")
    if getattr(AsyncLLM, "_outrate_guarded", False):
        return
    stock = AsyncLLM.add_request

    async def add_request(
        self: Any, request_id: str, prompt: Any, params: Any, *a: Any, **kw: Any
    ) -> Any:
        _check_params(prompt, params)
        stamp_params(prompt, params)
        return await stock(self, request_id, prompt, params, *a, **kw)

    AsyncLLM.add_request = add_request
    AsyncLLM._outrate_guarded = True


def install_request_guards() -> None:
    from vllm.exceptions import VLLMValidationError

    from vllm_integration.common.compat import locate

    install_engine_client_guard()
    for cls, _ in locate("OpenAI request models"):  # each model's to_sampling_params
        if getattr(cls, "_outrate_guarded", False):
            continue
        stock_sampling = cls.to_sampling_params

        def to_sampling_params(
            self: Any, *args: Any, _stock: Any = stock_sampling, **kw: Any
        ) -> Any:
            check_identity(self)
            return _stock(self, *args, **kw)

        cls.to_sampling_params = to_sampling_params
        if hasattr(cls, "to_beam_search_params"):

            def to_beam_search_params(self: Any, *args: Any, **kw: Any) -> Any:
                raise VLLMValidationError(BEAM_SEARCH_MESSAGE, parameter="use_beam_search")

            cls.to_beam_search_params = to_beam_search_params
        cls._outrate_guarded = True
