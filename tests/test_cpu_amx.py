"""vllm_integration/startup/cpu_amx.py: the AMX permission request on vLLM's CPU platform.

The unit tests run on any machine: in a fresh process they read the
permission back from the kernel (`arch_prctl(ARCH_GET_XCOMP_PERM)`), so on a
CPU with AMX they see it granted, and elsewhere they see nothing asked. The
refusal path fakes only the kernel's answer and checks what vLLM's real
attention selector then picks. The e2e test starts a fresh server whose very
first request must get its tokens: without the request, on a CPU with AMX,
vLLM's CPU attention dies there with SIGILL.
"""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_integration.startup import cpu_amx, launcher, plugin  # noqa: E402
from vllm_integration.startup.cpu_amx import Amx, enable_amx  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

x86_linux = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="arch_prctl(ARCH_GET_XCOMP_PERM) is x86-64 Linux only",
)

# Run in a fresh process: nothing has asked for AMX there yet (oneDNN asks on
# its first AMX matmul, so the test process itself may already hold it).
_FRESH = """
import ctypes, json
SYS_arch_prctl, ARCH_GET_XCOMP_PERM, XTILEDATA = 158, 0x1022, 1 << 18
libc = ctypes.CDLL(None, use_errno=True)
def permitted():
    mask = ctypes.c_ulong(0)
    if libc.syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return None  # a kernel before 5.16: no dynamic features at all
    return bool(mask.value & XTILEDATA)
import torch
before = permitted()
from vllm_integration.startup.cpu_amx import enable_amx
found = enable_amx()
print(json.dumps({"amx": torch.cpu._is_amx_tile_supported(), "before": before,
                  "after": permitted(), "found": found.name}))
"""


@x86_linux
def test_the_request_is_granted_where_the_cpu_has_amx() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FRESH],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"this machine: {seen}")
    if seen["amx"]:
        assert seen["before"] is False  # a fresh process holds no permission
        assert seen["found"] == "GRANTED"
        assert seen["after"] is True  # the kernel says it is granted now
    else:
        assert seen["found"] == "ABSENT"
        assert seen["after"] == seen["before"]  # nothing asked


def test_a_refused_permission_makes_vllm_attention_take_its_non_amx_kernel(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    # The CPU reports AMX; the kernel refuses the permission (an old kernel,
    # a hypervisor that hides the state). Only the answers are faked.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    if platform.machine() in ("x86_64", "AMD64"):
        assert _get_attn_isa(torch.bfloat16, 32) == "amx"  # what would crash
    with caplog.at_level(logging.WARNING, logger="vllm.outrate"):
        assert enable_amx() is Amx.REFUSED
        assert enable_amx() is Amx.ABSENT  # idempotent: AMX is hidden now
    said = [r.getMessage() for r in caplog.records if "AMX" in r.getMessage()]
    assert len(said) == 1, said
    assert "refused AMX permission" in said[0] and "non-AMX kernel" in said[0]
    assert _get_attn_isa(torch.bfloat16, 32) != "amx"
    if platform.machine() in ("x86_64", "AMD64"):
        assert _get_attn_isa(torch.bfloat16, 32) == "vec"  # stock's own x86 choice


def test_nothing_is_asked_off_the_cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    def never() -> bool:
        raise AssertionError("asked for AMX on a GPU platform")

    monkeypatch.setattr(cpu_amx, "on_cpu_platform", lambda: False)
    monkeypatch.setattr(torch.cpu, "_init_amx", never)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert enable_amx() is Amx.NOT_CPU


def test_a_failing_cpu_fix_never_takes_vllm_down(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> Amx:
        raise AttributeError("module 'torch.cpu' has no attribute '_init_amx'")

    monkeypatch.setattr(cpu_amx, "enable_amx", broken)
    with caplog.at_level(logging.ERROR, logger="vllm.outrate"):
        plugin.register_cpu_fixes()  # vLLM calls it outside any try: must not raise
    assert any("CPU platform fix failed" in r.getMessage() for r in caplog.records)


def test_outrate_serve_sleeps_in_vllms_busy_wait_by_default_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env: dict[str, str] = {}
    assert launcher.default_spin_sleep(env) is True
    assert env == {"OUTRATE_SHM_SPIN_SLEEP_US": launcher.SPIN_SLEEP_DEFAULT_US}
    off = {"OUTRATE_SHM_SPIN_SLEEP_US": "0"}  # =0 turns it off, and is kept
    assert launcher.default_spin_sleep(off) is False
    assert off == {"OUTRATE_SHM_SPIN_SLEEP_US": "0"}
    monkeypatch.setattr(cpu_amx, "on_cpu_platform", lambda: False)
    gpu: dict[str, str] = {}
    assert launcher.default_spin_sleep(gpu) is False
    assert gpu == {}


@pytest.mark.e2e
@pytest.mark.beside
def test_a_fresh_server_answers_its_very_first_request(tmp_path: Path) -> None:
    """The issue's reproduction: a fresh `outrate serve`, nothing run before,
    one short completion. On a CPU with AMX it was HTTP 500 and a worker dead
    of SIGILL without the permission request. Without a policy, so stock
    vLLM's scheduler runs: with one, the first request of every e2e module's
    fresh server is the same check (the `server` fixture's warm-up)."""
    import openai
    from build_tiny_model import build
    from serverproc import ServerProcess, tiny_model_flags

    model = build(REPO / "models" / "tiny-llama")
    argv = [sys.executable, "-m", "outrate", "serve", *tiny_model_flags(model)]
    server = ServerProcess(argv, log_path=tmp_path / "server.log", name="fresh")
    with server.start(timeout_s=300):
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 5
        assert server.death() is None
        log = server.log_path.read_text()
    assert "died unexpectedly" not in log
