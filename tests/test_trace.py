"""Where the trace may be written (`check_trace_path`, run at startup and by
`outrate lint`; `open_trace_file`, the engine core's open) and what the writer
does when the disk refuses a write (says so once; the engine serves on).

The check used to be nothing: a FIFO blocked the engine core in open() for
good, and a directory, /dev/full or a path under a file killed the engine after
the model loaded; a symlink had the trace replace what it pointed to."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from outrate.errors import OutrateError
from outrate.observe.trace import TraceWriter, read_trace
from outrate.observe.tracefile import TRACE_START, check_trace_path, open_trace_file

PRECIOUS = "someone's notes\n"


def _directory(path: Path) -> None:
    path.mkdir()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()  # the socket file stays


def _symlink_to_a_file(path: Path) -> None:
    precious = path.with_name("precious.txt")
    precious.write_text(PRECIOUS)
    path.symlink_to(precious)


def _symlink_to_a_trace(path: Path) -> None:  # refused too: links are never followed
    target = path.with_name("old-trace.jsonl")
    target.write_bytes(TRACE_START + b"}\n")
    path.symlink_to(target)


def _dangling_symlink(path: Path) -> None:
    path.symlink_to(path.with_name("nowhere.jsonl"))


def _not_a_trace(path: Path) -> None:
    path.write_text(PRECIOUS)


LINK = "is a symbolic link (outrate does not follow links: name the file itself)"
REFUSED: dict[str, tuple[Callable[[Path], None], str]] = {
    "directory": (_directory, "is a directory"),
    "fifo": (_fifo, "is not a regular file (a FIFO)"),
    "socket": (_socket, "is not a regular file (a socket)"),
    "symlink-to-a-file": (_symlink_to_a_file, LINK),
    "symlink-to-a-trace": (_symlink_to_a_trace, LINK),
    "dangling-symlink": (_dangling_symlink, LINK),
    "not-a-trace": (_not_a_trace, "is not an outrate trace; refusing to overwrite it"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_check_refuses_each_kind_of_path_with_its_message(case: str, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    make, why = REFUSED[case]
    make(path)
    with pytest.raises(OutrateError) as exc:
        check_trace_path(path)
    assert str(exc.value) == f"{path}: {why}"
    if case == "symlink-to-a-file":
        assert (tmp_path / "precious.txt").read_text() == PRECIOUS


def test_check_refuses_a_missing_parent_and_a_file_as_parent(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "t.jsonl"
    with pytest.raises(OutrateError) as exc:
        check_trace_path(missing)
    assert str(exc.value) == f"{missing}: directory {missing.parent} does not exist"
    assert not missing.parent.exists()  # not created either
    (tmp_path / "file.txt").write_text("x")
    for under in (tmp_path / "file.txt" / "t.jsonl", tmp_path / "file.txt" / "d" / "t.jsonl"):
        with pytest.raises(OutrateError) as exc:
            check_trace_path(under)
        assert str(exc.value) == f"{under}: {under.parent} is not a directory"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_check_refuses_dev_full() -> None:
    with pytest.raises(OutrateError) as exc:
        check_trace_path("/dev/full")
    assert str(exc.value) == "/dev/full: is not a regular file (a character device)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a mode-0555 directory")
def test_check_refuses_a_directory_it_cannot_write(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(OutrateError) as exc:
        check_trace_path(locked / "t.jsonl")
    assert str(exc.value) == f"{locked / 't.jsonl'}: directory {locked} is not writable"


def test_check_asks_os_access_whether_it_may_write(tmp_path: Path, monkeypatch) -> None:
    """Under root (where the tests run) no mode bit refuses a write, so the
    test above skips; this one shows the check asks `os.access`, the same
    question a non-root server would get a refusal to."""
    existing = tmp_path / "old.jsonl"
    existing.write_bytes(b"")
    asked: list[tuple[str, int]] = []

    def access(path: str | os.PathLike[str], mode: int) -> bool:
        asked.append((os.fspath(path), mode))
        return False

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(OutrateError) as exc:
        check_trace_path(tmp_path / "t.jsonl")
    assert str(exc.value) == f"{tmp_path / 't.jsonl'}: directory {tmp_path} is not writable"
    assert asked == [(str(tmp_path), os.W_OK | os.X_OK)]
    monkeypatch.setattr(os, "access", lambda p, m: os.fspath(p) == str(tmp_path))
    with pytest.raises(OutrateError) as exc:
        check_trace_path(existing)
    assert str(exc.value) == f"{existing}: is not writable"


def test_check_allows_a_new_path_an_empty_file_and_a_trace(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert check_trace_path("new.jsonl") == tmp_path / "new.jsonl"  # absolute
    assert not (tmp_path / "new.jsonl").exists()  # the check creates nothing
    (tmp_path / "empty.jsonl").touch()
    assert check_trace_path("empty.jsonl") == tmp_path / "empty.jsonl"
    writer = TraceWriter(str(tmp_path / "trace.jsonl"), header={"policy": "x"})
    writer.stop()
    assert check_trace_path(tmp_path / "trace.jsonl") == tmp_path / "trace.jsonl"
    torn = tmp_path / "torn.jsonl"  # a disk that filled up in the header
    torn.write_bytes(TRACE_START[:7])
    assert check_trace_path(torn) == torn
    linked = tmp_path / "linked-dir"  # a link among the parents is an ordinary path
    linked.symlink_to(tmp_path)
    assert check_trace_path(linked / "new.jsonl") == linked / "new.jsonl"


# -- the engine core's open: the path may have changed since the check ---------


def _open_in_a_thread(path: Path) -> BaseException | None:
    """open_trace_file's error, failing the test if it blocks."""
    result: list[BaseException | None] = []

    def attempt() -> None:
        try:
            open_trace_file(str(path)).close()
            result.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result.append(e)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive(), f"open_trace_file({path}) blocked"
    return result[0]


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_engine_open_never_blocks_follows_a_link_or_overwrites(
    case: str, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    make, why = REFUSED[case]
    make(path)
    error = _open_in_a_thread(path)
    assert isinstance(error, OutrateError)
    if case == "socket":  # open() itself refuses a socket
        assert str(error) == f"{path}: cannot open: No such device or address"
    else:
        assert str(error) == f"{path}: {why}"
    if case == "symlink-to-a-file":
        assert (tmp_path / "precious.txt").read_text() == PRECIOUS
    if case == "not-a-trace":
        assert path.read_text() == PRECIOUS
    if case == "dangling-symlink":
        assert not (tmp_path / "nowhere.jsonl").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_the_engine_open_refuses_dev_full() -> None:
    error = _open_in_a_thread(Path("/dev/full"))
    assert str(error) == "/dev/full: is not a regular file (a character device)"


def test_the_engine_open_rewrites_a_trace_from_the_start(tmp_path: Path) -> None:
    """Today's behaviour for a real trace: each start writes it afresh."""
    path = tmp_path / "trace.jsonl"
    for run in (1, 2):
        writer = TraceWriter(str(path), header={"run": run})
        writer.step((run, run, 1, {"a": 1}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, 0, 0))
        writer.stop()
    lines = read_trace(path)
    assert [line.get("run") for line in lines] == [2, None]
    assert lines[1] == {"t": 2, "step": 2, "running": 1, "charged": {"a": 1}}


def test_prompt_tokens_are_a_step_field_left_out_when_empty(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(str(path))
    writer.step((5, 5, 2, {}, {}, {}, {}, {}, {}, {}, {}, {"mallory": 101}, {}, {}, {}, 0, 0))
    writer.step((6, 6, 2, {"bob": 1}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, 0, 0))
    writer.stop()
    lines = read_trace(path)[1:]
    assert lines == [
        {"t": 5, "step": 5, "running": 2, "prompt": {"mallory": 101}},
        {"t": 6, "step": 6, "running": 2, "charged": {"bob": 1}},
    ]
    path.write_text(path.read_text() + '{"t":7,"step":7,"prompt":{"mallory":1.5}}\n')
    with pytest.raises(OutrateError, match=r":4:1: <line>: not a trace line: prompt: expected"):
        read_trace(path)


# -- a disk that refuses writes: said once, never raised into the engine --------

_FULL_DISK = textwrap.dedent(
    """
    import logging, resource, signal, sys
    from outrate.observe.trace import TraceWriter
    logging.basicConfig(stream=sys.stderr, format="%(message)s")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    writer = TraceWriter(sys.argv[1], header={"pad": "p" * 100})
    writer.start()
    for step in range(5000):
        writer.step((step, step, 1, {"alice": 1}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, 0, 0))
    writer.stop()
    print("served on")
    """
)


@pytest.mark.parametrize("limit", [64, 65536], ids=["at-the-header", "mid-run"])
def test_a_full_disk_stops_the_trace_once_and_nothing_else(limit: int, tmp_path: Path) -> None:
    """A real write error on a regular file (RLIMIT_FSIZE: EFBIG, the same
    OSError path as ENOSPC), at the first line or later: the writer warns once
    and gives up; the process goes on. At the header it used to raise from
    TraceWriter(), which killed the engine."""
    path = tmp_path / "t.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(path), str(limit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "served on\n"), done.stderr
    assert done.stderr.splitlines() == [
        f"outrate: {path}: cannot write the trace: [Errno 27] File too large"
    ]
    assert path.stat().st_size <= limit


def test_a_steps_predicted_length_and_slope_are_written_where_the_model_ran(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(str(path))
    writer.step((5, 5, 2, {"bob": 1}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, 7250, 900))
    writer.step((6, 6, 2, {"bob": 1}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, 7250, 0))
    writer.step((7, 7, 2, {"bob": 1}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, 0, 0))
    writer.stop()
    lines = read_trace(path)[1:]
    assert [r.get("predicted_us") for r in lines] == [7250, 7250, None]
    assert [r.get("per_seq_us") for r in lines] == [900, 0, None]  # 0: free, said
    for key, bad in (("predicted_us", "7.5"), ("per_seq_us", '"900"')):
        line = f'{{"t":8,"step":8,"{key}":{bad}}}\n'
        (tmp_path / "bad.jsonl").write_text(path.read_text() + line)
        with pytest.raises(OutrateError, match=rf":5:1: <line>: not a trace line: {key}: exp"):
            read_trace(tmp_path / "bad.jsonl")
