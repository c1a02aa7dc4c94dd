"""The patch index (vllm_integration.common.patches.PATCHES) lists every vLLM method the
scheduler subclasses override, so none goes unexplained."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from vllm_integration.common.patches import PATCHES  # noqa: E402
from vllm_integration.step.scheduler import OutrateMixin  # noqa: E402


def test_every_override_of_a_vllm_scheduler_method_is_indexed():
    overridden = {
        name
        for name in vars(OutrateMixin)
        if callable(getattr(OutrateMixin, name)) and hasattr(Scheduler, name)
    }
    indexed = {p.target.split(".", 1)[1] for p in PATCHES if p.target.startswith("Scheduler.")}
    assert overridden - {"__init__"} == indexed
    for p in PATCHES:
        assert p.why and p.until and p.where
