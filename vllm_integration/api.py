"""API-server guards: refuse bad identities and beam search with HTTP 400.

Patches `to_sampling_params` / `to_beam_search_params` of vLLM 0.32's OpenAI
request models (completions, chat completions, responses). vLLM maps a
`VLLMValidationError` raised there to a 400 response naming the parameter.
Beam search is refused because each beam is sampled by the API server's own
loop of engine requests, whose tokens the per-user limiter cannot attribute
to one stream. Installed only in the API server, only when a policy is active.
"""

from __future__ import annotations

import importlib
from typing import Any

from outrate.identity import IDENTITY_KEY, identity_error

_MODELS = (
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
)

BEAM_SEARCH_MESSAGE = (
    "beam search is not supported while an outrate policy is active: beams are "
    "sampled outside the per-user output-token limiter"
)


def check_identity(request: Any) -> None:
    """Raise VLLMValidationError (HTTP 400) for a present but invalid identity."""
    from vllm.exceptions import VLLMValidationError

    xargs = getattr(request, "vllm_xargs", None)
    if not xargs or IDENTITY_KEY not in xargs:
        return
    error = identity_error(xargs[IDENTITY_KEY])
    if error is not None:
        raise VLLMValidationError(error, parameter=f"vllm_xargs.{IDENTITY_KEY}")


def install_request_guards() -> None:
    from vllm.exceptions import VLLMValidationError

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
