"""Ask Linux for AMX before vLLM's CPU attention uses it.

vLLM 0.32's CPU attention (`_get_attn_isa` in
`vllm/v1/attention/backends/cpu_attn.py`) picks its "amx" kernel whenever
`torch.cpu._is_amx_tile_supported()` is true, the dtype is bf16 and the block
size is a multiple of 32. Linux lets a process run AMX tile instructions only
after it asked once with `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`,
and vLLM's kernel never asks. oneDNN asks when it first runs an AMX matmul of
its own, so whether a worker survives its first forward depended on what ran
first in it: on a CPU that reports AMX (Sapphire Rapids and later) a fresh
server died on its first request with SIGILL (exit code -4), in stock vLLM as
in outrate.

`enable_amx()` makes the request (`torch.cpu._init_amx()`: the same syscall,
then it reads the permission back) in every process that loads the plugin on
the CPU platform: vLLM loads general plugins in its workers before the model
loads (`WorkerWrapperBase.init_worker`), so the permission is in place before
the first forward. The permission belongs to the process, so every thread of
the worker (OpenMP's too) has it, and a spawned process asks again.

If the kernel refuses (before Linux 5.16, or a hypervisor that hides the AMX
state), the process's `torch.cpu._is_amx_tile_supported` answers False, so
vLLM's CPU attention takes its non-AMX kernel ("vec"), as do vLLM's other CPU
kernels that ask the same question; one warning says so. Nothing happens on
any other platform, or on a CPU without AMX.

Can go when vLLM's CPU attention asks for the permission itself.
"""

from __future__ import annotations

import logging
from enum import Enum

logger = logging.getLogger("vllm.outrate")


class Amx(Enum):
    """What `enable_amx` found (the tests read it)."""

    NOT_CPU = "not vLLM's CPU platform"
    ABSENT = "the CPU reports no AMX"
    GRANTED = "AMX permission granted"
    REFUSED = "AMX permission refused"


def enable_amx() -> Amx:
    """Ask for AMX on vLLM's CPU platform; on refusal, hide AMX from vLLM."""
    if not on_cpu_platform():
        return Amx.NOT_CPU
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return Amx.ABSENT  # also what a second call finds after a refusal
    if torch.cpu._init_amx():
        logger.debug("outrate: AMX permission granted to this process")
        return Amx.GRANTED
    torch.cpu._is_amx_tile_supported = _no_amx
    logger.warning(
        "outrate: the kernel refused AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM): "
        "vLLM's CPU attention uses its non-AMX kernel in this process"
    )
    return Amx.REFUSED


def _no_amx() -> bool:
    return False


def on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
