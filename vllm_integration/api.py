"""API-server guards: refuse bad identities and beam search with HTTP 400.

Identity (one rule set, `outrate.identity`, on every route):

- `IdentityGuard`, an ASGI middleware (vLLM's documented `--middleware`
  hook, added by the plugin): before any route runs, a JSON request body
  whose `vllm_xargs.output_rate_user` or `sampling_params.extra_args.
  output_rate_user` (vLLM's token-in route, `/inference/v1/generate`) is
  invalid is answered 400, in vLLM's error format (Anthropic's on
  `/v1/messages`). It sees the JSON as sent, so `true` is reported as a
  boolean, not as the `1` vLLM's request models turn it into, and no route
  can start a 200 stream first or log a traceback.
- `AsyncLLM.add_request` (patched in the API server): anything that still
  reaches the engine client with an invalid identity (a route that takes its
  arguments as a form, say) is refused there with `VLLMValidationError`.
- The engine itself maps an invalid identity to the anonymous budget
  (`resolve_identity`): the last line, never the first.

Beam search: `to_beam_search_params` of vLLM 0.32's OpenAI request models is
patched to refuse it: each beam is sampled by the API server's own loop of
engine requests, whose tokens the per-user limiter cannot attribute to one
stream. Installed only in the API server, only when a policy is active.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from outrate.identity import IDENTITY_FIELD, IDENTITY_KEY, identity_error

_MODELS = (
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
)

GUARD_MIDDLEWARE = "vllm_integration.api.IdentityGuard"
"""What the plugin appends to `--middleware`."""

BEAM_SEARCH_MESSAGE = (
    "beam search is not supported while an outrate policy is active: beams are "
    "sampled outside the per-user output-token limiter"
)

_ANTHROPIC_PREFIX = "/v1/messages"
_KEY = IDENTITY_KEY.encode()

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def body_identity_error(body: bytes) -> tuple[str, str] | None:
    """(message, parameter) for a JSON body carrying an invalid identity.

    Where vLLM's routes read it: `vllm_xargs` (OpenAI, Anthropic, SageMaker
    routes) and `sampling_params.extra_args` (`/inference/v1/generate`).
    Bodies that do not parse are left to vLLM, which answers them itself.
    """
    if _KEY not in body and b"\\u" not in body:  # the key can be \\u-escaped
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    params = data.get("sampling_params")
    places = [("vllm_xargs", data.get("vllm_xargs"))]
    if isinstance(params, dict):
        places.append(("sampling_params.extra_args", params.get("extra_args")))
    for name, args in places:
        if isinstance(args, dict) and IDENTITY_KEY in args:
            field = f"{name}.{IDENTITY_KEY}"
            error = identity_error(args[IDENTITY_KEY], field)
            if error is not None:
                return error, field
    return None


class IdentityGuard:
    """ASGI middleware: a POST whose JSON body has an invalid identity gets 400."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        while True:  # the whole body: the route would read all of it anyway
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        found = body_identity_error(body)
        if found is not None:
            await _refuse(scope, receive, send, *found)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return b"json" in value.lower()
    return False


async def _refuse(scope: Scope, receive: Receive, send: Send, message: str, field: str) -> None:
    """400 in exactly the shape vLLM gives its own validation errors."""
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMValidationError

    error = create_error_response(VLLMValidationError(message, parameter=field))
    if str(scope.get("path", "")).startswith(_ANTHROPIC_PREFIX):
        from vllm.entrypoints.anthropic.api_router import translate_error_response

        response = translate_error_response(error)
    else:
        response = JSONResponse(error.model_dump(), status_code=error.error.code)
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


def install_engine_client_guard() -> None:
    """Patch `AsyncLLM.add_request` (vLLM 0.32), the one door of every route to
    the engine: an invalid identity is refused before the request is sent."""
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM, "_outrate_guarded", False):
        return
    stock = AsyncLLM.add_request

    async def add_request(
        self: Any, request_id: str, prompt: Any, params: Any, *a: Any, **kw: Any
    ) -> Any:
        _check_params(prompt, params)
        return await stock(self, request_id, prompt, params, *a, **kw)

    AsyncLLM.add_request = add_request  # type: ignore[method-assign]
    AsyncLLM._outrate_guarded = True  # type: ignore[attr-defined]


def install_request_guards() -> None:
    from vllm.exceptions import VLLMValidationError

    install_engine_client_guard()
    for module_name, class_name in _MODELS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
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
