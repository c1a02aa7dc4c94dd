"""Opt-in fix for vLLM's busy wait on small CPU machines (`OUTRATE_SHM_SPIN_SLEEP_US`).

vLLM 0.32's shared-memory message queue (`vllm.distributed.device_communicators.
shm_broadcast`) spins with `sched_yield()` while a reader waits for the next
message: the engine core waits so for each step's result from the worker. On
the 2-core CPU machine this project tests on, that spin kept the engine core at
~72% of a core and the API server saw nothing for seconds: a client of stock
vLLM or of outrate got its first token, then no token for ~7 s, then all of
them at once, although the engine had sampled them at an even pace (the
engine-side trace shows gaps of <= 62 ms for a 20 tok/s user in the same run).

With `OUTRATE_SHM_SPIN_SLEEP_US=100` the spin sleeps 100 us instead of
yielding: the same run showed client-side gaps of <= 61 ms, the engine core at
30% of a core and the whole load finishing sooner (7.45 s vs 8.1 s). Set it in
the environment of `vllm serve` / `outrate serve`; every vLLM process (API
server, engine core, worker) loads this plugin and applies it. Unset, nothing
changes. Can go when vLLM's spin backs off on its own on small machines.
"""

from __future__ import annotations

import time

from outrate.env import SHM_SPIN_SLEEP_US, Env

ENV = SHM_SPIN_SLEEP_US


def install_spin_sleep() -> bool:
    """Patch the spin if the environment asks for it; True if patched."""
    raw = Env.read().shm_spin_sleep_us
    if not raw:
        return False
    try:
        seconds = float(raw) / 1e6
    except ValueError:
        return False
    if seconds <= 0:
        return False
    from vllm_integration.common.compat import owner_of

    shm_broadcast = owner_of("shm_broadcast.sched_yield")

    if getattr(shm_broadcast, "_outrate_spin_sleep", None) == seconds:
        return True

    def sched_yield() -> None:
        time.sleep(seconds)

    setattr(shm_broadcast, "sched_yield", sched_yield)  # noqa: B010 - not re-exported
    setattr(shm_broadcast, "_outrate_spin_sleep", seconds)  # noqa: B010
    return True
