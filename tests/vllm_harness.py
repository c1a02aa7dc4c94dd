"""Drive the real vLLM 0.32 Scheduler / AsyncScheduler with fabricated model
outputs and a fake clock. The scheduler, the KV cache manager and the request
objects are vLLM's own; only the model (sampled tokens) and time are fake."""

from __future__ import annotations

import itertools
import logging
import sys
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from outrate.policy.compiler import CompiledPolicy
from vllm_integration import enginecore
from vllm_integration.offline.outputs import model_runner_output
from vllm_integration.step import OutrateAsyncScheduler, OutrateScheduler
from vllm_integration.step.steptime import Prior

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from build_tiny_model import build  # noqa: E402

logging.getLogger("vllm").setLevel(logging.WARNING)

BLOCK = 16
MS = 1_000_000
S = 1_000_000_000
TOKEN = 7  # any non-EOS id; requests use ignore_eos anyway


class FakeClock:
    def __init__(self, start: int = 10 * S) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


_MODEL_DIR: Path | None = None


def model_dir() -> Path:
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = build(REPO / "models" / "tiny-llama")
    return _MODEL_DIR


def vllm_config(
    *,
    max_num_seqs: int = 16,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 512,
    chunked: bool = True,
    prefix_caching: bool = True,
    priority: bool = False,
    outrate: dict[str, Any] | None = None,
    scheduler: dict[str, Any] | None = None,
) -> VllmConfig:
    mc = ModelConfig(
        model=str(model_dir()),
        dtype="bfloat16",
        max_model_len=2048,
        skip_tokenizer_init=True,
        enforce_eager=True,
    )
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048,
        is_encoder_decoder=False,
        enable_chunked_prefill=chunked,
        policy="priority" if priority else "fcfs",
        **(scheduler or {}),  # fields of this vLLM's SchedulerConfig
    )
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
    extra = {"outrate": outrate} if outrate is not None else {}
    return VllmConfig(
        model_config=mc, scheduler_config=sc, cache_config=cc, additional_config=extra
    )


FLAT_STEPS = Prior(fixed_us=10_000, per_decode_us=0, per_prefill_us=0)
"""The Driver's default clock as a step model: every step 10 ms, whatever it
holds. The scheduler's prior of its step cost (steptime.py) unless a test
gives another: on this clock borrowed work costs no time."""


def make_scheduler(
    kind: str,
    policy: CompiledPolicy | None = None,
    clock: FakeClock | None = None,
    num_blocks: int = 4096,
    step_model: Any = FLAT_STEPS,
    **config: Any,
) -> Any:
    """kind: 'sync' | 'async' (outrate) or 'stock-sync' | 'stock-async' (vLLM's own)."""
    cls = {
        "sync": OutrateScheduler,
        "async": OutrateAsyncScheduler,
        "stock-sync": Scheduler,
        "stock-async": AsyncScheduler,
    }[kind]
    stock = kind.startswith("stock")
    vc = vllm_config(outrate=None if stock else {"reload": "off"}, **config)
    vc.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
                ),
            )
        ],
    )
    sched = (cls if stock else partial(enginecore.build, cls))(
        vllm_config=vc,
        kv_cache_config=kv,
        block_size=BLOCK,
        structured_output_manager=StructuredOutputManager(vc),
        log_stats=False,
    )
    if not stock and policy is not None:
        sched.outrate_configure(policy, clock=clock or FakeClock(), step_model=step_model)
    return sched


_ids = itertools.count()


def make_request(
    user: str | None = None,
    prompt_len: int = 8,
    max_tokens: int = 16,
    priority: int = 0,
    prompt: list[int] | None = None,
    req_id: str | None = None,
    xargs: dict[str, Any] | None = None,
) -> Request:
    extra = dict(xargs or {})
    if user is not None:
        extra["output_rate_user"] = user
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)
    n = next(_ids)
    tokens = prompt if prompt is not None else [(n * 31 + i) % 500 + 3 for i in range(prompt_len)]
    return Request(
        request_id=req_id or f"r{n}",
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        priority=priority,
        block_hasher=_hasher(),
    )


def _hasher() -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


@dataclass
class Driver:
    """Steps a scheduler like the engine does; one step behind for async."""

    sched: Any
    clock: FakeClock | None = None
    step_ns: int = 10 * MS
    step_cost: Callable[[Any], int] | None = None  # a step's length from its output, else step_ns
    emitted: dict[str, int] = field(default_factory=dict)  # req id -> tokens delivered
    user_of: dict[str, str] = field(default_factory=dict)
    timeline: list[tuple[int, str]] = field(default_factory=list)  # (time, user) per token
    finished: set[str] = field(default_factory=set)
    steps: int = 0
    _pending: deque = field(default_factory=deque)

    @property
    def is_async(self) -> bool:
        return isinstance(self.sched, AsyncScheduler)

    def add(self, req: Request) -> Request:
        self.user_of[req.request_id] = (req.sampling_params.extra_args or {}).get(
            "output_rate_user", "__anonymous__"
        )
        self.sched.add_request(req)
        return req

    def step(self) -> Any:
        out = self.sched.schedule()
        samplers = [
            rid for rid in out.num_scheduled_tokens if not self.sched.requests[rid].is_prefill_chunk
        ]
        self._pending.append((out, samplers))
        if not out.num_scheduled_tokens:
            self.drain()  # like the engine: nothing new in flight, collect what is
        elif not self.is_async or len(self._pending) >= 2:
            self._deliver()
        self.steps += 1
        if self.clock is not None:
            self.clock.advance(self.step_ns if self.step_cost is None else self.step_cost(out))
        return out

    def _deliver(self) -> None:
        out, samplers = self._pending.popleft()
        ids = list(out.num_scheduled_tokens)
        mro = model_runner_output(ids, [[TOKEN] if r in samplers else [] for r in ids])
        outputs = self.sched.update_from_output(out, mro)
        now = self.clock.now if self.clock is not None else 0
        for eco in outputs.values():
            for o in eco.outputs:
                k = len(o.new_token_ids)
                self.emitted[o.request_id] = self.emitted.get(o.request_id, 0) + k
                self.timeline.extend((now, self.user_of.get(o.request_id, "?")) for _ in range(k))
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)

    def drain(self) -> None:
        while self._pending:
            self._deliver()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def run_until_done(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests() and not self._pending:
                return
            self.step()
        raise AssertionError("requests did not finish")

    def tokens_of(self, user: str) -> int:
        return sum(n for rid, n in self.emitted.items() if self.user_of.get(rid) == user)


def user_times(timeline: Iterable[tuple[int, str]], user: str) -> list[int]:
    return [t for t, u in timeline if u == user]
