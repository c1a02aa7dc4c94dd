"""What travels from the API server to the engine core: `EngineSettings`.

vLLM carries it in `VllmConfig.additional_config["outrate"]`, which it hashes
and pickles, so on the way it is a plain dict (`to_config`, `from_config`);
on both ends it is this frozen record. Secrets never travel here: the store's
password and the identity secret go through the environment (outrate.env).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from outrate.errors import OutrateError
from outrate.observe.tracefile import rank_path

__all__ = ["CONFIG_KEY", "EngineSettings", "ReloadMode", "dp_suffix", "rank_path"]

CONFIG_KEY = "outrate"
ReloadMode = Literal["watch", "poll", "off"]


@dataclass(frozen=True)
class EngineSettings:
    policy: str | None = None
    """`--outrate-policy`, absolute. None: the in-memory policy of the two rate flags."""
    default_rate: float | None = None
    """`--default-user-output-tokens-per-second` (without a policy file)."""
    user_rates: dict[str, Any] | str | None = None
    """`--user-output-tokens-per-second` (without a policy file)."""
    reload: ReloadMode = "watch"
    """`--outrate-reload`."""
    trace: str | None = None
    """`--outrate-trace`, absolute; each data-parallel rank writes its own file."""
    trace_max_bytes: int | None = None
    store: str | None = None
    """`--outrate-store` without its password."""
    store_fallback: str = "local"
    """`--outrate-store-fallback`, its current name (outrate.budget.shared.credit.FALLBACKS)."""
    store_lease_ms: int | None = None
    store_hold_s: float | None = None
    """`--outrate-store-hold-s` (None: outrate.budget.shared.peers.HOLD_S)."""
    store_engines: int | None = None
    """`--outrate-store-engines`: what an engine that never reached its store divides by."""
    data_parallel_size: int = 1
    """As asked for: vLLM resets it to 1 in each non-MoE data-parallel engine core."""
    quota_file: str | None = None
    """`--outrate-quota-file`, absolute: usage saved by the engine, read by the API server."""
    metrics_dir: str | None = None
    """Where the engine writes its metrics snapshots (the API server serves them)."""
    vllm_api_key: bool = False
    """vLLM checks API keys itself (`--api-key`): api_key identity is refused beside it."""

    def to_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> EngineSettings:
        """The record vLLM's config carried. A field this version does not
        know means the API server and the engine core run different outrates."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise OutrateError(
                f"additional_config[{CONFIG_KEY!r}] has fields this outrate does not know: "
                f"{', '.join(unknown)} (the API server and the engine core run different versions?)"
            )
        return cls(**raw)

    def replace(self, **changes: Any) -> EngineSettings:
        return dataclasses.replace(self, **changes)


def dp_suffix(vllm_config: Any, settings: EngineSettings | None = None) -> str:
    """`.dp<rank>` for a data-parallel engine, "" otherwise: each engine core
    of a data-parallel deployment writes its own trace and metrics file.

    vLLM 0.32 reconfigures each non-MoE data-parallel engine core as an
    independent engine (`data_parallel_size = 1`) and keeps its rank only in
    `data_parallel_index`; the size the user asked for comes from the
    settings (the plugin records it)."""
    pc = getattr(vllm_config, "parallel_config", None)
    size = settings.data_parallel_size if settings else getattr(pc, "data_parallel_size", 1)
    if pc is None or (size or 1) <= 1:
        return ""
    rank = getattr(pc, "data_parallel_index", None)
    if rank is None:
        rank = getattr(pc, "data_parallel_rank", 0)
    return f".dp{rank}"
