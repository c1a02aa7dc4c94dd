"""Every file outrate is handed goes through one reader (`outrate.fileread`):
policies, keys files, workloads, step models, vLLM `--config` files and
traces. Only regular files, never blocking, never more than the kind's limit
(and, for traces, a line's): each refusal one located line, in seconds and
in bounded memory.

`simulate calibrate --trace /dev/zero` used to read one endless "line" (4 GB
in 6.5 s, then a MemoryError traceback), and a FIFO with no writer blocked it
for good; a trace line nested 1,500 deep raised a RecursionError traceback."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from outrate.check.deployment import deployment_from_config
from outrate.cli import app
from outrate.errors import OutrateError
from outrate.fileread import MIB, FileLimit, FileReadError, read_bounded, read_lines
from outrate.observe.trace import TRACE_FILE, read_trace
from outrate.policy.keys import load_keys
from outrate.policy.loader import load_policy
from outrate.simulate.stepmodel import load_step_model
from outrate.simulate.workload import WORKLOAD_FILE, load_workload

runner = CliRunner()

READERS: dict[str, Callable[[Path], Any]] = {
    "policy": load_policy,
    "keys": load_keys,
    "workload": load_workload,
    "trace": read_trace,
    "step model": load_step_model,
    "vLLM config": deployment_from_config,
}


def _in_a_thread(read: Callable[[], Any], fifo: Path | None = None) -> BaseException:
    """What `read` raised, from a thread given 10 s; a reader blocked in
    open() on `fifo` is released before the test fails."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            read()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            caught.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY))
        pytest.fail("the read blocked")
    assert caught, "nothing was refused"
    return caught[0]


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_refuses_what_is_not_a_regular_file(
    tmp_path: Path, reader: str, kind: str
) -> None:
    path = tmp_path / "file"
    if kind == "fifo":
        os.mkfifo(path)
        why = "a FIFO"
    else:
        path.symlink_to(kind)
        why = "a character device"
    error = _in_a_thread(lambda: READERS[reader](path), path)
    assert isinstance(error, OutrateError)
    assert str(error) == f"{path}:1:1: <file>: cannot read: not a regular file ({why})"


def _calibrate(trace: Path | str) -> tuple[Any, float]:
    started = time.monotonic()
    result = runner.invoke(app, ["simulate", "calibrate", "--trace", str(trace)])
    return result, time.monotonic() - started


def _one_line_refusal(result: Any, line: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.stderr == line + "\n"
    assert result.stdout == ""
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_calibrate_refuses_dev_zero_at_once() -> None:
    result, took = _calibrate("/dev/zero")
    _one_line_refusal(
        result, "/dev/zero:1:1: <file>: cannot read: not a regular file (a character device)"
    )
    assert took < 5


def test_calibrate_refuses_a_fifo_without_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(_calibrate(fifo)), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))
        pytest.fail("calibrate --trace blocked on a FIFO")
    result, took = out[0]
    _one_line_refusal(result, f"{fifo}:1:1: <file>: cannot read: not a regular file (a FIFO)")
    assert took < 5


def test_a_trace_line_nested_1500_deep_is_a_located_error(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"trace":"outrate","version":1}\n' + "[" * 1500 + "]" * 1500 + "\n")
    result, _ = _calibrate(trace)
    _one_line_refusal(result, f"{trace}:2:1: <line>: not a trace line: nested too deep")


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("[1, 2]", "expected a JSON object (got list)"),
        ('{"t": "soon", "step": 1}', "t: expected a whole number"),
        (
            '{"t": 1, "step": 1, "charged": {"a": [1]}}',
            "charged: expected an object of whole numbers",
        ),
        ('{"t": 1, "step": 1, "held": 3}', "held: expected an object of whole numbers"),
    ],
)
def test_a_json_line_that_is_no_trace_line_is_a_located_error(
    tmp_path: Path, line: str, why: str
) -> None:
    """The fit used to fail on these later, with a traceback."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"trace":"outrate","version":1}\n' + line + "\n")
    result, _ = _calibrate(trace)
    _one_line_refusal(result, f"{trace}:2:1: <line>: not a trace line: {why}")


def test_a_torn_last_line_is_still_skipped(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 1, "step": 1, "charged": {"a": 1}}\n{"t": 2, "st')
    assert read_trace(trace) == [{"t": 1, "step": 1, "charged": {"a": 1}}]


def test_an_endless_line_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """32 MiB without a newline (what /dev/zero looked like, in a regular
    file): refused at the line limit, having held about two chunks."""
    trace = tmp_path / "trace.jsonl"
    with open(trace, "wb") as f:
        for _ in range(32):
            f.write(b"\0" * MIB)
    tracemalloc.start()
    try:
        with pytest.raises(FileReadError) as info:
            read_trace(trace)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value) == (
        f"{trace}:1:1: <file>: cannot read: line 1 is longer than {MIB} bytes"
    )
    assert peak < 8 * MIB, f"peak {peak / MIB:.1f} MiB"


def test_lines_are_numbered_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a\n\nbcd\n" + b"x" * 10 + b"\nlast")
    limit = FileLimit("a test file", 100, line=10)
    assert list(read_lines(path, limit)) == [
        (1, b"a"), (2, b""), (3, b"bcd"), (4, b"x" * 10), (5, b"last"),
    ]  # fmt: skip
    path.write_bytes(b"a\n" + b"x" * 11 + b"\n")
    with pytest.raises(FileReadError, match=r":2:1: <file>: cannot read: line 2 is longer than"):
        list(read_lines(path, limit))


def test_a_trace_has_a_generous_limit_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twice the writer's default cap; OUTRATE_MAX_TRACE_BYTES changes it and
    the refusal names that variable (not the policy's)."""
    monkeypatch.delenv("OUTRATE_MAX_TRACE_BYTES", raising=False)
    assert TRACE_FILE.default == 512 * MIB and TRACE_FILE.line == MIB
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 1, "step": 1}\n' * 10)
    monkeypatch.setenv("OUTRATE_MAX_TRACE_BYTES", "100")
    result, _ = _calibrate(trace)
    _one_line_refusal(
        result,
        f"{trace}:1:1: <file>: cannot read: 200 bytes is more than the limit of 100 bytes "
        "(set OUTRATE_MAX_TRACE_BYTES to change it)",
    )


def test_a_workload_over_its_limit_names_the_workload_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload = tmp_path / "load.yaml"
    workload.write_text("version: 1\nduration: 1s\nusers: {a: {streams: 1, prompt: 1, output: 1}}")
    monkeypatch.setenv("OUTRATE_MAX_POLICY_BYTES", "10")  # not the workload's
    assert load_workload(workload).workload.duration == 1_000_000_000
    monkeypatch.setenv("OUTRATE_MAX_WORKLOAD_BYTES", "10")
    result = runner.invoke(app, ["simulate", "stock", "-w", str(workload)])
    assert result.exit_code == 1
    assert result.stderr == (
        f"{workload}:1:1: <file>: cannot read: {workload.stat().st_size} bytes is more than "
        "the limit of 10 bytes (set OUTRATE_MAX_WORKLOAD_BYTES to change it)\n"
    )
    monkeypatch.setenv("OUTRATE_MAX_WORKLOAD_BYTES", "lots")
    with pytest.raises(OutrateError, match="OUTRATE_MAX_WORKLOAD_BYTES='lots' is not a whole"):
        load_workload(workload)
    assert WORKLOAD_FILE.default == 64 * MIB


def test_a_fixed_limit_names_the_kind_of_file(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_bytes(b" " * (MIB + 1))
    with pytest.raises(OutrateError) as info:
        load_step_model(path)
    assert str(info.value) == (
        f"{path}:1:1: <file>: cannot read: {MIB + 1} bytes is more than the limit of "
        f"{MIB} bytes for a step model"
    )


def test_a_file_that_grows_past_the_limit_while_read() -> None:
    """/proc files say size 0 and then deliver bytes: only the read can tell."""
    limit = FileLimit("a test file", 10)
    for read in (read_bounded, lambda p, lim: list(read_lines(p, lim))):
        with pytest.raises(FileReadError, match="cannot read: it grew past the limit of 10"):
            read("/proc/self/status", limit)


def _vllm_config_bomb(kind: str) -> str:
    """A vLLM `--config` file whose `max_num_seqs` is 5,000 levels of `[`, or
    a 9^9 alias bomb ("billion laughs")."""
    if kind == "nesting":
        return "max_num_seqs: " + "[" * 5000 + "]" * 5000 + "\n"
    rows = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    rows += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join([*rows, "max_num_seqs: *a8", ""])


@pytest.mark.parametrize(
    ("kind", "refusal"),
    [
        ("nesting", "1:47: <root>: nested deeper than 32 levels (the limit)"),
        (
            "aliases",
            "5:5: <root>: aliases expand to more than 10000 values beyond the file's own "
            "(alias bomb?)",
        ),
    ],
)
@pytest.mark.parametrize("command", ["lint --vllm-config", "lint -- --config", "simulate"])
def test_a_vllm_config_file_is_parsed_within_the_policy_limits(
    tmp_path: Path, kind: str, refusal: str, command: str
) -> None:
    """A policy's nesting and alias limits hold for a vLLM `--config` file
    too: its bounded read was parsed by PyYAML alone, so 5,000 levels of `[`
    were a RecursionError traceback and an alias bomb took gigabytes and
    minutes, in lint and in simulate."""
    config = tmp_path / "serve.yaml"
    config.write_text(_vllm_config_bomb(kind))
    policy = str(Path(__file__).parent.parent / "policies" / "demo.yaml")
    workload = tmp_path / "load.yaml"
    workload.write_text("version: 1\nduration: 1s\nusers: {a: {streams: 1, prompt: 1, output: 1}}")
    argv = {
        "lint --vllm-config": ["lint", policy, "--vllm-config", str(config)],
        "lint -- --config": ["lint", policy, "--", "--config", str(config)],
        "simulate": [
            "simulate",
            "run",
            "stock",
            "-w",
            str(workload),
            "--",
            "--config",
            str(config),
        ],
    }[command]
    started = time.monotonic()
    result = runner.invoke(app, argv)
    _one_line_refusal(result, f"{config}:{refusal}")
    assert time.monotonic() - started < 5
