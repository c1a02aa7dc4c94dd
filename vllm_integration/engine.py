"""Engine-loop patch: wait on the input queue instead of spinning when every
request is throttled.

vLLM 0.32's `EngineCoreProc._process_engine_step` sleeps 1 ms and loops when
no model ran but requests exist: a busy spin while everyone is throttled.
After such a step we block on the engine's input queue for
`scheduler.outrate_idle_wait_ns()` (at most 50 ms, until the earliest user is
ready), so a new request or an abort wakes the engine at once and nothing
sleeps inside `schedule()`. Only acts when the scheduler is outrate's.
Can go when vLLM lets a scheduler report how long it has nothing to do.
"""

from __future__ import annotations

import queue
from typing import Any


def install_idle_wait() -> None:
    """Patch `EngineCoreProc._process_engine_step` once per process."""
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, "_outrate_idle_wait", False):
        return
    stock = EngineCoreProc._process_engine_step

    def _process_engine_step(self: Any) -> bool:
        executed = stock(self)
        if not executed:
            wait_ns = getattr(self.scheduler, "outrate_idle_wait_ns", None)
            ns = wait_ns() if wait_ns is not None else 0
            if ns > 0:
                try:
                    req = self.input_queue.get(timeout=ns / 1e9)
                except queue.Empty:
                    pass
                else:
                    self._handle_client_request(*req)
        return bool(executed)

    EngineCoreProc._process_engine_step = _process_engine_step
    EngineCoreProc._outrate_idle_wait = True
