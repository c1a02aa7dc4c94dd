"""KV allocation that preempts held (throttled) requests first.

Stock preempts from `running` when the KV cache is full, and held requests
are not in `running`: without this, a throttled user's parked blocks would
outlive the requests of users with budget. `HeldFirstAllocation` replaces
`kv_cache_manager.allocate_slots` (an instance attribute) only in steps that
start with held requests: the wrapper costs a Python call per allocation.
It never reads the manager's `__dict__`: CPython then moves the manager's
attributes into a dict, and every attribute read in vLLM's allocation path
(per request, per step) gets slower.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any


class HeldFirstAllocation:
    def __init__(self, sched: Any) -> None:
        self.sched = sched
        kvm = sched.kv_cache_manager
        with contextlib.suppress(AttributeError):
            del kvm.allocate_slots  # re-wiring: back to the class method
        self.stock = kvm.allocate_slots
        self.installed = False

    def install(self, on: bool) -> None:
        """Wrap `allocate_slots` for this step (`on`: it starts with held requests)."""
        if on:
            self.sched.kv_cache_manager.allocate_slots = self
            self.installed = True
        elif self.installed:
            del self.sched.kv_cache_manager.allocate_slots
            self.installed = False

    def __call__(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        sched = self.sched
        alloc = self.stock
        holdback = sched.holdback
        if holdback and kwargs.get("has_scheduled_reqs") is False:
            kwargs["has_scheduled_reqs"] = True  # held requests are scheduled work too
        while True:
            blocks = alloc(request, num_new_tokens, *args, **kwargs)
            if blocks is not None or not holdback:
                return blocks
            victim = holdback.kv_victim(sched.running)
            if victim is None:
                return None  # a visible lower-priority request goes first (stock's choice)
            # Stock's admission loop peeks the head of `waiting` and pops it
            # later: keep the victim aside, requeue it at the front after the step.
            sched._preempt_request(victim, time.monotonic())
            sched.waiting.remove_request(victim)
            sched._st.stash.append(victim)
