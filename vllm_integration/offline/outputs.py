"""The model's output, fabricated: vLLM's `ModelRunnerOutput` for a step in
which each listed request sampled the tokens given.

One place knows how each vLLM builds it (the simulator, the scheduler tests
and the benchmarks all build it here): vLLM 0.32 and 0.33 also take
`req_id_to_index`; 0.34 dropped that field and matches outputs by `req_ids`
order. Which form is read off the installed class's fields, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cache
from typing import Any


@cache
def _takes_index() -> bool:
    from vllm.v1.outputs import ModelRunnerOutput

    return "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def model_runner_output(req_ids: Sequence[str], sampled: Sequence[list[int]]) -> Any:
    """`sampled[i]`: the tokens `req_ids[i]` sampled in the step ([] for a
    request whose step was a prefill chunk that samples nothing)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(req_ids)
    if _takes_index():  # vLLM 0.32, 0.33
        index = {r: i for i, r in enumerate(ids)}
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index=index, sampled_token_ids=list(sampled)
        )
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=list(sampled))  # type: ignore[call-arg]
