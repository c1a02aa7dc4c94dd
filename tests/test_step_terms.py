"""benchmarks/step_terms.py (docs/simulate.md, "Out of sample"): on a
simulated trace of the calibration workload and a case back to back, whose
steps last exactly what one linear model says, it finds both workloads and
the model carries over (no term is missing there)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import step_terms  # noqa: E402

from outrate.observe.trace import read_trace  # noqa: E402
from outrate.simulate.engine import engine_from_flags  # noqa: E402
from outrate.simulate.stepmodel import StepModel  # noqa: E402
from outrate.simulate.workload import load_workload  # noqa: E402
from vllm_integration.offline.simulator import simulate  # noqa: E402

pytestmark = pytest.mark.vllm
WORKLOADS = REPO / "examples" / "workloads"


def test_a_linear_engine_carries_over(tmp_path, capsys):
    model = StepModel(fixed_us=3000, per_decode_us=500, per_prefill_us=30)
    engine = engine_from_flags(["--max-num-seqs", "12", "--max-num-active-seqs", "8"])
    combined = tmp_path / "trace.jsonl"
    with combined.open("w") as out:
        for i, name in enumerate(("e2e-agree", "oos-hog")):
            trace = tmp_path / f"{name}.jsonl"
            w = load_workload(WORKLOADS / f"{name}.yaml").workload
            simulate(w, engine, WORKLOADS / "oos-policy.yaml", model, trace=trace)
            for r in read_trace(trace):  # one server's trace: the second run later
                if "step" in r:
                    r["t"] += i * 100 * 10**9
                    r["step"] += i * 10**6
                    out.write(json.dumps(r) + "\n")
    assert [k for k, _ in step_terms.segments(read_trace(combined))] == ["e2e-agree", "oos-hog"]
    assert step_terms.main([str(combined)]) == 0
    printed = capsys.readouterr().out
    print(printed)
    for term in step_terms.TERMS:
        found = re.search(rf"\+ {term}: .*oos-hog ([-+]\d+)% -> ([-+]\d+)%", printed)
        assert found is not None, term
        assert abs(int(found.group(1))) <= 5  # the model is the engine: nothing missing
