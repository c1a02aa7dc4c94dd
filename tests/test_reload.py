"""Hot reload against a real watchdog observer, one test per way files get edited.

Every wait goes through the reloader's own wait helpers with a timeout; no test
sleeps to synchronize. The only sleep-free way to show that something did NOT
happen is a witness: a second, watching reloader on the same file that must see
the edit (see the `mode="off"` test) or the `checks` counter (the file was
looked at and found unchanged).
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from outrate.budget.gcra import PEAK_UNLIMITED
from outrate.errors import PolicyError
from outrate.policy.changes import describe_changes
from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.loader import parse_policy
from outrate.policy.pipeline import load_compiled
from outrate.policy.reload import Reloader

pytestmark = pytest.mark.waits  # make test's waits lane (tests/lanes.py)

T = 5.0
"""Seconds any single wait may take before the test fails."""


def policy_text(default: str = "100", **users: object) -> str:
    lines = ["version: 1", f"default: {default}"]
    if users:
        lines.append("users:")
        lines += [f"  {name}: {rate}" for name, rate in users.items()]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Replace the file in one step, so no half-written state can be observed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rates(policy: CompiledPolicy | None) -> dict[str, int | None]:
    assert policy is not None
    return {
        u: None if lim.rate is None else int(lim.rate) for u, lim in sorted(policy.users.items())
    }


class Harness:
    """A started reloader plus what `on_apply` received, and when."""

    def __init__(self, reloader: Reloader, calls: list[tuple[float, CompiledPolicy]]) -> None:
        self.r = reloader
        self.calls = calls

    def expect_applied(self, n: int) -> None:
        assert self.r.wait_applied(n, T), f"not applied #{n}: last_error={self.r.last_error}"

    def expect_rates(self, expected: dict[str, int | None]) -> None:
        """Wait for the final content: a half-written state may apply or fail first."""
        ok = self.r.wait_for(lambda r: r.current is not None and rates(r.current) == expected, T)
        assert ok, f"current={self.r.current} last_error={self.r.last_error}"

    def expect_rejected(self, n: int) -> None:
        assert self.r.wait_rejected(n, T), f"not rejected #{n} (applied={self.r.applied})"


@pytest.fixture
def start() -> Iterator[Callable[..., Harness]]:
    made: list[Reloader] = []

    def _start(path: Path | str, **kw: object) -> Harness:
        calls: list[tuple[float, CompiledPolicy]] = []
        r = Reloader(path, lambda p: calls.append((time.monotonic(), p)), **kw)  # type: ignore[arg-type]
        made.append(r)
        r.start()
        return Harness(r, calls)

    yield _start
    for r in made:
        r.stop()


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    p = tmp_path / "policy.yaml"
    p.write_text(policy_text(alice=20, bob=30))
    return p


# -- startup ---------------------------------------------------------------


def test_start_loads_and_applies_the_file(start: Callable[..., Harness], policy: Path) -> None:
    h = start(policy)
    assert (h.r.applied, h.r.rejected, h.r.last_error) == (1, 0, None)
    assert h.r.observer_kind == "native"
    assert [p for _, p in h.calls] == [h.r.current]
    assert rates(h.r.current) == {"alice": 20, "bob": 30}


def test_initial_policy_is_not_applied_again(start: Callable[..., Harness], policy: Path) -> None:
    initial = load_compiled(policy)
    h = start(policy, initial=initial)
    assert h.r.current is initial and h.r.applied == 0
    checks = h.r.checks
    os.utime(policy)  # an event, same bytes
    assert h.r.wait_checked(checks + 1, T)
    assert h.r.applied == 0 and h.r.current is initial


def test_missing_file_at_start_applies_once_created(
    start: Callable[..., Harness], tmp_path: Path
) -> None:
    p = tmp_path / "policy.yaml"
    h = start(p)
    assert h.r.current is None and h.r.rejected == 1
    assert h.r.last_error == f"{p}:1:1: <file>: cannot read: No such file or directory"
    p.write_text(policy_text(alice=20))
    h.expect_applied(1)
    assert rates(h.r.current) == {"alice": 20} and h.r.last_error is None


# -- each kind of edit -----------------------------------------------------


def test_in_place_rewrite_in_chunks(start: Callable[..., Harness], policy: Path) -> None:
    h = start(policy)
    text = policy_text(alice=60, bob=30)
    with open(policy, "r+") as f:
        f.truncate(0)
        f.write(text[:10])
        f.flush()
        f.write(text[10:])
    h.expect_rates({"alice": 60, "bob": 30})


def test_write_temp_then_rename(start: Callable[..., Harness], policy: Path) -> None:
    h = start(policy)
    tmp = policy.with_name(".policy.yaml.tmp")
    tmp.write_text(policy_text(alice=61))
    os.replace(tmp, policy)
    h.expect_rates({"alice": 61})


def test_vim_style_backup_rename(start: Callable[..., Harness], policy: Path) -> None:
    """vim (backupcopy=no): move the original aside, write a new file, drop the backup."""
    h = start(policy)
    backup = policy.with_name("policy.yaml~")
    os.rename(policy, backup)
    policy.write_text(policy_text(alice=62, bob=30))
    backup.unlink()
    h.expect_rates({"alice": 62, "bob": 30})


def test_sed_in_place(
    start: Callable[..., Harness], policy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h = start(policy)
    caplog.set_level(logging.INFO, logger="outrate.reload")
    subprocess.run(["sed", "-i", "s/alice: 20/alice: 63/", str(policy)], check=True)
    h.expect_applied(2)
    assert rates(h.r.current) == {"alice": 63, "bob": 30}
    reloaded = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert reloaded == [f"{policy}: policy reloaded: alice 20 -> 63 tok/s"]


def test_kubernetes_configmap_symlink_swap(start: Callable[..., Harness], tmp_path: Path) -> None:
    v1 = tmp_path / "..2026_01"
    v1.mkdir()
    (v1 / "policy.yaml").write_text(policy_text(alice=20))
    os.symlink("..2026_01", tmp_path / "..data")
    os.symlink("..data/policy.yaml", tmp_path / "policy.yaml")
    h = start(tmp_path / "policy.yaml")
    assert rates(h.r.current) == {"alice": 20}

    v2 = tmp_path / "..2026_02"
    v2.mkdir()
    (v2 / "policy.yaml").write_text(policy_text(alice=64, carol=5))
    os.symlink("..2026_02", tmp_path / "..data_tmp")
    os.rename(tmp_path / "..data_tmp", tmp_path / "..data")  # atomic swap, as kubelet does
    (v1 / "policy.yaml").unlink()
    v1.rmdir()
    h.expect_rates({"alice": 64, "carol": 5})
    assert h.r.rejected == 0


def test_symlink_to_a_file_in_another_directory(
    start: Callable[..., Harness], tmp_path: Path
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    target = tmp_path / "real" / "p.yaml"
    target.write_text(policy_text(alice=20))
    link = tmp_path / "links" / "policy.yaml"
    os.symlink(target, link)
    h = start(link)
    target.write_text(policy_text(alice=65))  # only the target's directory sees this
    h.expect_rates({"alice": 65})


def test_a_symlink_retargeted_to_other_directories_is_followed(
    start: Callable[..., Harness], tmp_path: Path
) -> None:
    """`ln -sfn` to a new release directory, twice: each time the new target
    applies, and later edits in the new target's directory are seen (the old
    one is no longer watched)."""
    dirs = [tmp_path / f"release-{i}" for i in range(3)]
    for i, d in enumerate(dirs):
        d.mkdir()
        (d / "p.yaml").write_text(policy_text(alice=20 + i))
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "policy.yaml"
    os.symlink(dirs[0] / "p.yaml", link)
    h = start(link)
    assert rates(h.r.current) == {"alice": 20}
    for i, d in enumerate(dirs[1:], start=1):
        tmp = tmp_path / "links" / "policy.yaml.new"
        os.symlink(d / "p.yaml", tmp)
        os.rename(tmp, link)  # retarget atomically
        h.expect_rates({"alice": 20 + i})
        (d / "p.yaml").write_text(policy_text(alice=70 + i))  # only `d` sees this
        h.expect_rates({"alice": 70 + i})
    assert h.r.rejected == 0
    assert set(h.r._watches) == {str(tmp_path / "links"), str(dirs[2])}


def test_delete_keeps_serving_then_recreate_applies(
    start: Callable[..., Harness], policy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h = start(policy)
    before = h.r.current
    caplog.set_level(logging.INFO, logger="outrate.reload")
    policy.unlink()
    h.expect_rejected(1)
    msg = (
        f"{policy}: policy file deleted; keeping the last good policy (2 users, default 100 tok/s)"
    )
    assert h.r.last_error == msg
    assert any(r.levelno == logging.WARNING and r.getMessage() == msg for r in caplog.records)
    assert h.r.current is before
    policy.write_text(policy_text(alice=66))
    h.expect_rates({"alice": 66})


# -- partial and broken edits ----------------------------------------------


def test_partial_write_is_rejected_then_the_full_write_applies(
    start: Callable[..., Harness], policy: Path
) -> None:
    h = start(policy)
    text = policy_text(alice=20, bob=30, carol=40)
    cut = text.index("carol") + 2  # "  ca": a key without its colon is a YAML error
    with open(policy, "w") as f:
        f.write(text[:cut])
        f.flush()
        os.fsync(f.fileno())
        h.expect_rejected(1)  # the reloader saw the half-written file and refused it
        assert "invalid YAML" in (h.r.last_error or "")
        assert h.r.applied == 1
        f.write(text[cut:])
    h.expect_rates({"alice": 20, "bob": 30, "carol": 40})
    assert h.r.last_error is None


def test_burst_of_writes_collapses_into_one_check(
    start: Callable[..., Harness], policy: Path
) -> None:
    h = start(policy, debounce_s=0.5)
    checks = h.r.checks
    text = policy_text(alice=67, bob=30, carol=1, dave=2)
    with open(policy, "w") as f:
        for i in range(0, len(text), 8):
            f.write(text[i : i + 8])
            f.flush()
    h.expect_applied(2)
    assert h.r.checks == checks + 1 and h.r.rejected == 0
    assert rates(h.r.current) == {"alice": 67, "bob": 30, "carol": 1, "dave": 2}


def test_a_directory_that_never_goes_quiet_does_not_postpone_the_reload(
    start: Callable[..., Harness], policy: Path
) -> None:
    """A trace or log written beside the policy every 50 ms (shorter than the
    debounce) must not keep re-arming the timer forever: found on a live
    server whose --outrate-trace sat next to its policy."""
    h = start(policy)
    stop = threading.Event()

    def chatter() -> None:
        with open(policy.parent / "trace.jsonl", "a") as f:
            while not stop.is_set():
                f.write("{}\n")
                f.flush()
                time.sleep(0.05)

    noisy = threading.Thread(target=chatter, daemon=True)
    noisy.start()
    try:
        time.sleep(0.3)
        write_atomic(policy, policy_text(alice=77, bob=30, carol=40))
        h.expect_applied(2)  # within expect_applied's timeout, chatter or not
    finally:
        stop.set()
        noisy.join()
    assert rates(h.r.current)["alice"] == 77


BROKEN = {
    "syntax": "version: 1\ndefault: [100\n",
    "invalid value": "version: 1\ndefault: 100\nusers:\n  alice: -5\n",
    "duplicate key": "version: 1\ndefault: 100\nusers:\n  alice: 20\n  alice: 30\n",
    "unknown key": "version: 1\ndefault: 100\nuser:\n  alice: 20\n",
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_edit_is_rejected_with_lint_message(
    start: Callable[..., Harness], policy: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    h = start(policy)
    good = h.r.current
    caplog.set_level(logging.INFO, logger="outrate.reload")
    write_atomic(policy, BROKEN[kind])
    h.expect_rejected(1)
    with pytest.raises(PolicyError) as exc:
        load_compiled(policy)
    assert h.r.last_error == str(exc.value)
    assert any(
        r.levelno == logging.ERROR and r.getMessage().endswith("\n" + str(exc.value))
        for r in caplog.records
    )
    assert h.r.current is good and h.r.applied == 1 and len(h.calls) == 1
    write_atomic(policy, policy_text(alice=68))
    h.expect_applied(2)
    assert rates(h.r.current) == {"alice": 68} and h.r.rejected == 1


HOSTILE: dict[str, Callable[[Path, Path], str]] = {
    # name -> swap the policy for it (policy path, a scratch dir); the exact message
    "fifo": lambda p, d: _symlink(p, _fifo(d / "fifo"), "not a regular file (a FIFO)"),
    "/dev/zero": lambda p, d: _symlink(p, "/dev/zero", "not a regular file (a character device)"),
    "directory": lambda p, d: _symlink(p, d, "not a regular file (a directory)"),
}


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _symlink(policy: Path, target: object, why: str) -> str:
    tmp = policy.with_name(".link.tmp")
    os.symlink(target, tmp)
    os.replace(tmp, policy)
    return f"{policy}:1:1: <file>: cannot read: {why}"


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_what_is_not_a_file_is_refused_at_once_and_later_edits_apply(
    start: Callable[..., Harness], policy: Path, tmp_path: Path, kind: str
) -> None:
    """A FIFO used to block the reload thread forever: no later edit applied."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    h = start(policy)
    good = h.r.current
    message = HOSTILE[kind](policy, scratch)
    h.expect_rejected(1)
    assert h.r.last_error == message and h.r.current is good
    write_atomic(policy, policy_text(alice=60))
    h.expect_rates({"alice": 60})


def test_a_file_over_the_read_limit_is_refused_unread(
    start: Callable[..., Harness], policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTRATE_MAX_POLICY_BYTES", "200")
    h = start(policy)
    write_atomic(policy, policy_text(alice=20) + "#" * 200 + "\n")
    h.expect_rejected(1)
    assert h.r.last_error == (
        f"{policy}:1:1: <file>: cannot read: 244 bytes is more than the limit of 200 bytes "
        "(set OUTRATE_MAX_POLICY_BYTES to change it)"
    )
    write_atomic(policy, policy_text(alice=61))
    h.expect_rates({"alice": 61})


def test_the_digest_is_the_sha256_the_policy_was_compiled_from(policy: Path) -> None:
    r = Reloader(policy, lambda p: None, mode="off")
    assert r._digest() == load_compiled(policy).sha256


def test_an_edit_between_the_engine_load_and_the_reloader_is_applied(
    start: Callable[..., Harness], policy: Path
) -> None:
    """The first check compares with the bytes `initial` was compiled from."""
    initial = load_compiled(policy)
    write_atomic(policy, policy_text(alice=62))
    h = start(policy, initial=initial)
    h.expect_rates({"alice": 62})


def test_unexpected_loader_error_is_caught_and_logged(
    start: Callable[..., Harness], policy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fail = threading.Event()

    def loader(path: object) -> CompiledPolicy:
        if fail.is_set():
            raise RuntimeError("disk on fire")
        return load_compiled(path)  # type: ignore[arg-type]

    h = start(policy, loader=loader)
    good = h.r.current
    caplog.set_level(logging.INFO, logger="outrate.reload")
    fail.set()
    policy.write_text(policy_text(alice=69))
    h.expect_rejected(1)
    assert h.r.last_error == f"{policy}: RuntimeError: disk on fire"
    assert any(r.exc_info and r.levelno == logging.ERROR for r in caplog.records)
    assert h.r.current is good
    fail.clear()  # the worker survived: the next edit still applies
    policy.write_text(policy_text(alice=70))
    h.expect_applied(2)


def test_on_apply_failure_keeps_the_old_policy(tmp_path: Path, policy: Path) -> None:
    applied: list[CompiledPolicy] = []

    def on_apply(p: CompiledPolicy) -> None:
        if p.users["alice"].rate == 71:
            raise RuntimeError("engine said no")
        applied.append(p)

    r = Reloader(policy, on_apply)
    r.start()
    try:
        policy.write_text(policy_text(alice=71))
        assert r.wait_rejected(1, T)
        assert r.current is applied[0] and r.applied == 1
        assert r.last_error == f"{policy}: on_apply: RuntimeError: engine said no"
    finally:
        r.stop()


def test_reload_now(policy: Path) -> None:
    r = Reloader(policy, lambda p: None, mode="off")
    assert r.reload_now() is True and r.applied == 1
    policy.write_text(BROKEN["syntax"])
    assert r.reload_now() is False and r.rejected == 1
    policy.write_text(policy_text(alice=72))
    assert r.reload_now() is True and rates(r.current) == {"alice": 72}


def test_a_peak_edit_applies_with_its_log_line(
    policy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the peak moves: an effective change, applied and logged; a peak
    below the rate is refused and the last good peak keeps serving."""
    caplog.set_level(logging.INFO, logger="outrate.reload")
    r = Reloader(policy, lambda p: None, mode="off")
    assert r.reload_now() is True
    policy.write_text(policy_text(alice="{rate: 20, peak: unlimited}", bob=30))
    assert r.reload_now() is True and r.applied == 2
    assert r.current is not None and r.current.users["alice"].peak == PEAK_UNLIMITED
    policy.write_text(policy_text(alice="{rate: 20, peak: 10}", bob=30))
    assert r.reload_now() is False and r.rejected == 1
    assert r.last_error is not None and "users.alice.peak: must be at least the rate" in (
        r.last_error
    )
    assert r.current.users["alice"].peak == PEAK_UNLIMITED
    reloaded = [m.getMessage() for m in caplog.records if m.levelno == logging.INFO]
    assert reloaded[1:] == [f"{policy}: policy reloaded: alice 20 tok/s -> 20 tok/s peak unlimited"]


# -- modes and lifecycle ---------------------------------------------------


def test_polling_mode(start: Callable[..., Harness], policy: Path) -> None:
    h = start(policy, mode="poll", poll_interval_s=0.1)
    assert h.r.observer_kind == "polling"
    policy.write_text(policy_text(alice=73, bob=30))
    h.expect_rates({"alice": 73, "bob": 30})


def test_native_observer_failure_falls_back_to_polling(
    start: Callable[..., Harness],
    policy: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import watchdog.observers
    from watchdog.observers.inotify import InotifyObserver

    class Exhausted(InotifyObserver):
        def start(self) -> None:
            raise OSError(errno.EMFILE, "inotify instance limit reached")

    monkeypatch.setattr(watchdog.observers, "Observer", Exhausted)
    caplog.set_level(logging.INFO, logger="outrate.reload")
    h = start(policy, poll_interval_s=0.1)
    assert h.r.observer_kind == "polling"
    assert any("native file watching unavailable" in r.getMessage() for r in caplog.records)
    policy.write_text(policy_text(alice=74))
    h.expect_applied(2)


def test_mode_off_never_reloads(start: Callable[..., Harness], policy: Path) -> None:
    off = start(policy, mode="off")
    witness = start(policy)
    assert off.r.applied == 1 and off.r.observer_kind is None
    policy.write_text(policy_text(alice=75))
    witness.expect_applied(2)  # the edit was visible to anyone watching
    assert off.r.applied == 1 and off.r.checks == 0
    assert rates(off.r.current) == {"alice": 20, "bob": 30}


def test_start_and_stop_are_idempotent(policy: Path) -> None:
    r = Reloader(policy, lambda p: None, debounce_s=0.05)
    r.start()
    r.start()
    assert r.applied == 1
    assert sum(t.name == "outrate-reload" for t in threading.enumerate()) == 1
    r.stop()
    r.stop()
    assert not any(t.name == "outrate-reload" for t in threading.enumerate())
    r.start()  # a stopped reloader can be started again
    try:
        policy.write_text(policy_text(alice=76))
        assert r.wait_applied(2, T)
    finally:
        r.stop()


def test_unchanged_bytes_do_not_reapply(start: Callable[..., Harness], policy: Path) -> None:
    h = start(policy)
    checks = h.r.checks
    policy.write_text(policy.read_text())
    assert h.r.wait_checked(checks + 1, T)
    assert h.r.applied == 1 and h.r.rejected == 0


def test_core_does_not_import_watchdog() -> None:
    code = "import sys, outrate.policy.reload; assert 'watchdog' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- describe_changes --------------------------------------------------------


def compiled(text: str) -> CompiledPolicy:
    return compile_policy(parse_policy(text, "p.yaml"), "p.yaml")


BASE = """\
version: 1
default: 100
tiers:
  gold: {rate: 50, max_streams: 4}
users:
  alice: 20
  bob: 30
  carol: {tier: gold}
match:
  - {pattern: 'team-*', rate: 10}
"""


TEAM_X = "team-x added (30 tok/s); bob removed (now default 100 tok/s)"
GOLD_80 = "tier gold 50 -> 80 tok/s max_streams 4; carol 50 -> 80 tok/s max_streams 4"
GOLD_PEAK = (
    "tier gold 50 tok/s max_streams 4 -> 50 tok/s peak 80 max_streams 4; "
    "carol 50 tok/s max_streams 4 -> 50 tok/s peak 80 max_streams 4"
)
TWO_PATTERNS = "  - {pattern: 'a*', rate: 10}\n  - {pattern: 'team-*', rate: 10}"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("", "", "no effective change"),
        ("alice: 20", "alice: 60", "alice 20 -> 60 tok/s"),
        ("  bob: 30\n", "", "bob removed (now default 100 tok/s)"),
        ("  bob: 30\n", "  bob: 30\n  dave: 5\n", "dave added (5 tok/s)"),
        ("  bob: 30\n", "  team-x: 30\n", TEAM_X),
        ("alice: 20", "alice: unlimited", "alice 20 tok/s -> unlimited"),
        ("alice: 20", "alice: {rate: 20, max_streams: 2}",
         "alice 20 tok/s -> 20 tok/s max_streams 2"),
        ("alice: 20", "alice: {rate: 20, burst: 1s}",
         "alice 20 tok/s -> 20 tok/s burst 1s"),
        ("alice: 20", "alice: {rate: 25, burst: 1s}",
         "alice 20 tok/s -> 25 tok/s burst 1s"),
        ("alice: 20", "alice: {tier: gold}", "alice 20 tok/s -> 50 tok/s max_streams 4"),
        ("bob: 30", "bob: {rate: 30, burst: 100ms}", "no effective change"),
        ("carol: {tier: gold}", "carol: {rate: 50, max_streams: 4}", "no effective change"),
        ("default: 100", "default: 200", "default 100 -> 200 tok/s"),
        ("default: 100", "default: 100\nanonymous: 5", "anonymous 100 -> 5 tok/s"),
        ("default: 100", "default: 100\nburst: 250ms", "burst 100ms -> 250ms"),
        ("rate: 50, max", "rate: 80, max", GOLD_80),
        ("'team-*', rate: 10", "'team-*', rate: 12", "pattern team-* 10 -> 12 tok/s"),
        ("alice: 20", "alice: {rate: 20, peak: unlimited}",
         "alice 20 tok/s -> 20 tok/s peak unlimited"),
        ("alice: 20", "alice: {rate: 20, peak: 20}", "no effective change"),
        ("alice: 20", "alice: {rate: 20, peak: 50, burst: 1s}",
         "alice 20 tok/s -> 20 tok/s burst 1s peak 50"),
        ("default: 100", "default: {rate: 100, peak: 200}",
         "default 100 tok/s -> 100 tok/s peak 200"),
        ("rate: 50, max", "rate: 50, peak: 80, max", GOLD_PEAK),
        ("carol: {tier: gold}", "carol: {tier: gold, peak: 60}",
         "carol 50 tok/s max_streams 4 -> 50 tok/s peak 60 max_streams 4"),
        ("'team-*', rate: 10", "'team-*', rate: 10, peak: unlimited",
         "pattern team-* 10 tok/s -> 10 tok/s peak unlimited"),
        ("  - {pattern: 'team-*', rate: 10}", TWO_PATTERNS, "pattern a* added (10 tok/s)"),
        # issue 42: a user turned to shadow logged "bob 30 tok/s -> 30 tok/s peak 40"
        ("bob: 30", "bob: {rate: 30, shadow: true}", "bob 30 tok/s -> 30 tok/s shadow"),
        ("bob: 30", "bob: {rate: 30, peak: 40, shadow: true}",
         "bob 30 tok/s -> 30 tok/s peak 40 shadow"),
        ("alice: 20", "alice: {rate: 20, shadow: false}", "no effective change"),
        ("default: 100", "default: 100\nmode: shadow",
         "default 100 tok/s -> 100 tok/s shadow; tier gold 50 tok/s max_streams 4 -> 50 tok/s "
         "max_streams 4 shadow; pattern team-* 10 tok/s -> 10 tok/s shadow; alice 20 tok/s -> "
         "20 tok/s shadow; bob 30 tok/s -> 30 tok/s shadow; carol 50 tok/s max_streams 4 -> "
         "50 tok/s max_streams 4 shadow"),
    ],
)  # fmt: skip
def test_describe_changes(old: str, new: str, expected: str) -> None:
    assert describe_changes(compiled(BASE), compiled(BASE.replace(old, new, 1))) == expected


def test_describe_removed_user_falls_back_to_pattern() -> None:
    old = compiled(BASE.replace("  bob: 30\n", "  team-a: 30\n"))
    assert describe_changes(old, compiled(BASE)) == (
        "bob added (30 tok/s); team-a removed (now match[0] team-* 10 tok/s)"
    )


def test_describe_a_peak_that_moves_or_stays() -> None:
    head = "version: 1\ndefault: 100\nusers:\n  alice: {rate: 20, peak: 100}\n"
    old = compiled(head)
    assert describe_changes(old, compiled(head.replace("peak: 100", "peak: 150"))) == (
        "alice 20 tok/s peak 100 -> 20 tok/s peak 150"
    )
    assert describe_changes(old, compiled(head.replace("rate: 20", "rate: 30"))) == (
        "alice 20 -> 30 tok/s peak 100"
    )
    assert describe_changes(old, compiled(head.replace(", peak: 100", ""))) == (
        "alice 20 tok/s peak 100 -> 20 tok/s"
    )
    # a new policy burst is reported once, not beside every rule with a peak
    assert describe_changes(old, compiled(head + "burst: 1s\n")) == "burst 100ms -> 1s"


def test_describe_a_prompt_limit_that_comes_moves_or_goes() -> None:
    head = "version: 1\ndefault: 100\nusers:\n  alice: 20\n"
    with_prompt = head.replace("alice: 20", "alice: {rate: 20, prompt: 500}")
    old, limited = compiled(head), compiled(with_prompt)
    assert describe_changes(old, limited) == "alice 20 tok/s -> 20 tok/s prompt 500 tok/s"
    wider = compiled(with_prompt.replace("prompt: 500", "prompt: {rate: 500, burst: 1s}"))
    assert describe_changes(limited, wider) == (
        "alice 20 tok/s prompt 500 tok/s -> 20 tok/s prompt 500 tok/s burst 1s"
    )
    assert describe_changes(limited, old) == "alice 20 tok/s prompt 500 tok/s -> 20 tok/s"
    # the prompt burst follows the policy's: a new policy burst is reported once
    new_burst = compiled(with_prompt + "burst: 1s\n")
    assert describe_changes(limited, new_burst) == "burst 100ms -> 1s"


def test_describe_reordered_patterns() -> None:
    two = "match:\n  - {pattern: 'a*', rate: 1}\n  - {pattern: 'ab*', rate: 2}\n"
    swapped = "match:\n  - {pattern: 'ab*', rate: 2}\n  - {pattern: 'a*', rate: 1}\n"
    head = "version: 1\ndefault: 100\n"
    assert describe_changes(compiled(head + two), compiled(head + swapped)) == "patterns reordered"


def test_describe_initial_load_and_long_lists_stay_one_line() -> None:
    assert describe_changes(None, compiled(BASE)) == (
        "loaded 3 users, 1 tier, 1 pattern, default 100 tok/s"
    )
    many = BASE.replace(
        "users:\n", "users:\n" + "".join(f"  u{i:02}: {i + 1}\n" for i in range(12))
    )
    line = describe_changes(compiled(BASE), compiled(many))
    assert "\n" not in line
    assert line == (
        "u00 added (1 tok/s); u01 added (2 tok/s); u02 added (3 tok/s); u03 added (4 tok/s); "
        "u04 added (5 tok/s); ... and 7 more"
    )


# -- files the policy depends on: the keys file of identity.source api_key ------

KEY_A = "sha256:" + "a" * 64
KEY_B = "sha256:" + "b" * 64


def keys_policy(keys: str = "keys.yaml") -> str:
    return f"version: 1\ndefault: 100\nidentity:\n  source: api_key\n  keys: {keys}\n"


def key_users(policy: CompiledPolicy | None) -> dict[str, str]:
    assert policy is not None and policy.identity.keys is not None
    return policy.identity.keys.digests()


def test_adding_and_revoking_a_key_reloads(
    start: Callable[..., Harness], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = tmp_path / "policy.yaml"
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"{KEY_A}: alice\n")
    policy.write_text(keys_policy())
    caplog.set_level(logging.INFO, logger="outrate.reload")
    h = start(policy, initial=load_compiled(policy))
    write_atomic(keys, f"{KEY_A}: alice\n{KEY_B}: bob\n")
    h.expect_applied(1)
    assert key_users(h.r.current) == {KEY_A: "alice", KEY_B: "bob"}
    write_atomic(keys, f"{KEY_B}: bob\n")
    h.expect_applied(2)
    assert key_users(h.r.current) == {KEY_B: "bob"}
    assert [r.getMessage() for r in caplog.records] == [
        f"{policy}: policy reloaded: key sha256:bbbbbbbbbbbb... (bob) added",
        f"{policy}: policy reloaded: key sha256:aaaaaaaaaaaa... (alice) revoked",
    ]


def test_a_broken_keys_file_keeps_the_last_good_keys(
    start: Callable[..., Harness], tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"{KEY_A}: alice\n")
    policy.write_text(keys_policy())
    h = start(policy)
    write_atomic(keys, f"{KEY_A}: [alice\n")
    h.expect_rejected(1)
    assert h.r.last_error is not None and h.r.last_error.startswith(
        f"{policy}:5:9: identity.keys: keys file {keys} is not usable\n{keys}:2:1: <root>: "
        "invalid YAML"
    )
    assert key_users(h.r.current) == {KEY_A: "alice"}
    keys.unlink()  # a deleted keys file is broken too: the last good keys stay
    h.expect_rejected(2)
    write_atomic(keys, f"{KEY_B}: bob\n")
    h.expect_applied(2)
    assert key_users(h.r.current) == {KEY_B: "bob"}


def test_an_in_place_rewrite_of_the_keys_file_never_revokes_every_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Truncate, then write: in between the file is zero bytes, which applied as
    "no keys" and answered every client 401 until the write landed. Here on the
    API server's own path: its `Gate`, fed by a `Reloader` that loads with
    `load_checked`, and `authenticate`, which decides each request's 401."""
    from outrate.identity.core import key_digest
    from outrate.identity.gate import authenticate
    from vllm_integration.apiserver.identity import Gate
    from vllm_integration.common.config import load_checked

    policy = tmp_path / "policy.yaml"
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"{key_digest('ork_alice')}: alice\n")
    policy.write_text(keys_policy())
    initial = load_checked(policy)
    gate = Gate(initial.identity)
    r = Reloader(policy, gate.publish, initial=initial, loader=load_checked)

    def who(key: str) -> str | int | None:
        verdict = authenticate(gate.identity, [(b"authorization", f"Bearer {key}".encode())])
        return verdict.user if verdict.status == 200 else verdict.status

    caplog.set_level(logging.INFO, logger="outrate.reload")
    r.start()
    try:
        checks = r.checks
        with open(keys, "w") as f:  # truncated: zero bytes until the write below
            assert r.wait_checked(checks + 1, T)
            assert (r.applied, r.rejected) == (0, 1)
            assert who("ork_alice") == "alice"  # the last good keys keep serving
            (tmp_path / "unrelated").write_text("x")  # another look at the same bytes
            assert r.wait_checked(checks + 2, T)
            assert r.rejected == 1 and who("ork_alice") == "alice"
            f.write(f"{key_digest('ork_bob')}: bob\n")
        assert r.wait_applied(1, T), r.last_error
        assert (who("ork_bob"), who("ork_alice")) == ("bob", 401)
        write_atomic(keys, "{}\n")  # what revokes every key
        assert r.wait_applied(2, T), r.last_error
        assert who("ork_bob") == 401 and gate.identity.keys is not None
        assert len(gate.identity.keys) == 0
    finally:
        r.stop()
    # Only the reloader's lines: the gate's own summary says "claims rejected".
    logged = [
        r.getMessage()
        for r in caplog.records
        if r.name == "outrate.reload" and "rejected" in r.getMessage()
    ]
    assert logged == [
        f"{policy}: reload rejected, keeping the last good policy:\n"
        f"{policy}:5:9: identity.keys: keys file {keys} is not usable\n"
        f"{keys}:1:1: <file>: empty (0 bytes), as a file being rewritten in place is before "
        "its first write: write '{}' to revoke every key (until then a running server keeps "
        "its last good keys)"
    ]  # once: the same bytes seen again are not reported again


def test_a_keys_file_elsewhere_is_watched_too_even_before_it_exists(
    start: Callable[..., Harness], tmp_path: Path
) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "secrets").mkdir()
    policy = tmp_path / "etc" / "policy.yaml"
    keys = tmp_path / "secrets" / "keys.yaml"
    policy.write_text(policy_text(alice=20))
    h = start(policy)
    write_atomic(policy, keys_policy("../secrets/keys.yaml"))
    h.expect_rejected(1)  # no keys file yet
    keys.write_text(f"{KEY_A}: alice\n")
    h.expect_applied(2)
    assert key_users(h.r.current) == {KEY_A: "alice"}
    write_atomic(keys, f"{KEY_B}: bob\n")
    h.expect_applied(3)
    assert key_users(h.r.current) == {KEY_B: "bob"}


def test_describe_identity_changes() -> None:
    head = "version: 1\ndefault: 100\n"
    header = head + "identity: {source: header, header: X-User}\n"
    assert describe_changes(compiled(head), compiled(header)) == (
        "identity body (vllm_xargs.output_rate_user, trusted as sent) -> header 'x-user', "
        "claims rejected"
    )
    ignore = header.replace("}", ", on_claim_mismatch: ignore}")
    assert describe_changes(compiled(header), compiled(ignore)) == (
        "identity header 'x-user', claims rejected -> header 'x-user', claims ignored"
    )
