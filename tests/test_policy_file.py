"""Reading a policy file: only regular files, never blocking, never more than
the read limit; every failure a located error (`path:1:1: <file>: ...`)."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from outrate.errors import PolicyError
from outrate.policy.file import DEFAULT_MAX_POLICY_BYTES, max_policy_bytes, read_policy_file


def _refusal(path: Path | str) -> str:
    with pytest.raises(PolicyError) as info:
        read_policy_file(path)
    (problem,) = info.value.problems
    assert problem[:4] == (str(path), 1, 1, "<file>")
    return problem.message


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(_refusal(fifo)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # blocked in open(): release it before failing
        os.close(os.open(fifo, os.O_WRONLY))
        pytest.fail("reading a FIFO blocked")
    assert result == ["cannot read: not a regular file (a FIFO)"]


@pytest.mark.parametrize(
    ("target", "kind"),
    [("/dev/zero", "a character device"), ("/dev/null", "a character device")],
)
def test_a_symlink_to_a_device_is_refused(tmp_path: Path, target: str, kind: str) -> None:
    link = tmp_path / "policy.yaml"
    link.symlink_to(target)
    assert _refusal(link) == f"cannot read: not a regular file ({kind})"


def test_a_directory_and_a_socket_are_refused(tmp_path: Path) -> None:
    assert _refusal(tmp_path) == "cannot read: not a regular file (a directory)"
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        assert _refusal(path) == "cannot read: not a regular file (a socket)"


def test_the_read_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes(b"x" * 100)
    monkeypatch.setenv("OUTRATE_MAX_POLICY_BYTES", "100")
    assert read_policy_file(path) == b"x" * 100
    monkeypatch.setenv("OUTRATE_MAX_POLICY_BYTES", "99")
    assert _refusal(path) == (
        "cannot read: 100 bytes is more than the limit of 99 bytes "
        "(set OUTRATE_MAX_POLICY_BYTES to change it)"
    )


def test_a_file_that_grows_past_the_limit_while_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc files say size 0 and then deliver bytes: only the read can tell."""
    monkeypatch.setenv("OUTRATE_MAX_POLICY_BYTES", "10")
    assert _refusal("/proc/self/status") == (
        "cannot read: it grew past the limit of 10 bytes "
        "(set OUTRATE_MAX_POLICY_BYTES to change it)"
    )


@pytest.mark.parametrize("value", ["lots", "0", "-5", "1.5"])
def test_a_bad_read_limit_is_a_located_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("OUTRATE_MAX_POLICY_BYTES", value)
    assert _refusal(tmp_path / "p.yaml") == (
        f"cannot read: OUTRATE_MAX_POLICY_BYTES={value!r} is not a whole number of bytes > 0"
    )


def test_the_default_limit_fits_a_million_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTRATE_MAX_POLICY_BYTES", raising=False)
    assert max_policy_bytes() == DEFAULT_MAX_POLICY_BYTES == 64 * 1024 * 1024
    line = "  user-0123456: {rate: 100, max_streams: 4}\n"
    assert len("version: 1\ndefault: 100\nusers:\n") + 1_000_000 * len(line) < max_policy_bytes()


@pytest.mark.parametrize(
    ("mode", "kind"), [(stat.S_IFBLK, "a block device"), (0o170000, "not a file")]
)
def test_every_other_kind_of_file_is_named(mode: int, kind: str) -> None:
    from outrate.fileread import FileReadError, _check_kind

    st = os.stat_result((mode | 0o600, 0, 0, 1, 0, 0, 0, 0, 0, 0))
    with pytest.raises(FileReadError) as info:
        _check_kind("p.yaml", st)
    assert str(info.value) == f"p.yaml:1:1: <file>: cannot read: not a regular file ({kind})"
