"""The keys file of `identity.source: api_key`, and `outrate keys add/revoke`."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from outrate.cli import app
from outrate.errors import OutrateError, PolicyError
from outrate.identity.core import KeyTable, key_digest
from outrate.policy.keys import HEADER, KEY_PREFIX, add_key, load_keys, parse_keys, revoke_keys
from outrate.policy.pipeline import load_compiled

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
C = "sha256:" + "c" * 64

BAD_KEYS: dict[str, tuple[str, list[str]]] = {
    "the key itself": (
        "ork_secret123: alice\n",
        [
            "FILE:1:1: ork_secret123: must be 'sha256:' and 64 lowercase hex digits (the "
            "digest of a key, never the key itself; outrate keys add writes it)"
        ],
    ),
    "uppercase hex": (
        f"{A.upper().replace('SHA256', 'sha256')}: alice\n",
        [
            "FILE:1:1: sha256:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAA...: must be 'sha256:' and 64 "
            "lowercase hex digits (the digest of a key, never the key itself; outrate keys "
            "add writes it)"
        ],
    ),
    "duplicate digest": (
        f"{A}: alice\n{B}: bob\n{A}: mallory\n",
        [
            "FILE:3:1: <root>: duplicate digest 'sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...' "
            "(first at line 1)"
        ],
    ),
    "user id a number": (
        f"{A}: 12345\n",
        [
            "FILE:1:74: sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...: user id must be a string; "
            "quote it: '12345'"
        ],
    ),  # fmt: skip
    "user id reserved": (
        f'{A}: "__anonymous__"\n',
        [
            "FILE:1:74: sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...: '__anonymous__' is reserved "
            "for requests without identity"
        ],
    ),  # fmt: skip
    "user id invisible": (
        f'{A}: "ali\\u200bce"\n',
        [
            "FILE:1:74: sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...: user id must not contain "
            "format characters (U+200B at index 3): 'ali\\u200bce'"
        ],
    ),  # fmt: skip
    "user id empty": (
        f'{A}: ""\n',
        ["FILE:1:74: sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...: user id must not be empty"],
    ),
    "user id with a trailing space": (
        f'{A}: "alice "\n',
        [
            "FILE:1:74: sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...: user id must not begin or "
            "end with whitespace (U+0020 at index 5): 'alice '"
        ],
    ),  # fmt: skip
    "user id with a trailing NBSP": (
        f'{A}: "alice\u00a0"\n{B}: "\u2003bob"\n',
        [
            "FILE:1:74: sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...: user id must not begin or "
            "end with whitespace (U+00A0 at index 5): 'alice\\xa0'",
            "FILE:2:74: sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbb...: user id must not begin or "
            "end with whitespace (U+2003 at index 0): '\\u2003bob'",
        ],
    ),  # fmt: skip
    "zero bytes": (
        "",
        [
            "FILE:1:1: <file>: empty (0 bytes), as a file being rewritten in place is before "
            "its first write: write '{}' to revoke every key (until then a running server "
            "keeps its last good keys)"
        ],
    ),
    "a list": (
        f"- {A}\n",
        ["FILE:1:1: <root>: a keys file is a mapping of 'sha256:<hex>: user id' (got a list)"],
    ),
    "invalid YAML": (
        f"{A}: [alice\n",
        [
            "FILE:2:1: <root>: invalid YAML: expected ',' or ']', but got '<stream end>' "
            "(while parsing a flow sequence at line 1)"
        ],
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_a_bad_keys_file_is_refused_with_every_problem_located(case: str, tmp_path: Path):
    text, expected = BAD_KEYS[case]
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_keys(path)
    assert [str(p) for p in info.value.problems] == [e.replace("FILE", str(path)) for e in expected]


def test_a_good_keys_file() -> None:
    raw = f"# comment\n{A}: alice\n{B}: 'team-x/bob'\n{C}: alice\n".encode()
    table = parse_keys(raw, "k.yaml")
    assert table.digests() == {A: "alice", B: "team-x/bob", C: "alice"}
    assert (table.source, table.sha256) == ("k.yaml", hashlib.sha256(raw).hexdigest())
    assert repr(table) == "KeyTable(3 keys from k.yaml)"  # never the digests


@pytest.mark.parametrize("text", ["{}\n", "{}", "# no keys yet\n", "\n", "\ufeff"])
def test_an_empty_keys_file_holds_no_keys(text: str) -> None:
    """`{}` (or comments only) is "revoke every key"; zero bytes is not (above)."""
    assert len(parse_keys(text.encode(), "k.yaml")) == 0


def test_a_key_is_found_by_its_digest_only() -> None:
    key = "ork_example"
    table = KeyTable([(bytes.fromhex(key_digest(key)[7:]), "alice")])
    assert table.lookup(key.encode()) == "alice"
    assert table.lookup(key_digest(key).encode()) is None  # the digest is not a key
    assert table.lookup(b"ork_exampl") is None


# -- through the policy ------------------------------------------------------------


def policy_with_keys(tmp_path: Path, keys: str = "keys.yaml") -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(f"version: 1\ndefault: 10\nidentity:\n  source: api_key\n  keys: {keys}\n")
    return path


def test_the_keys_file_is_relative_to_the_policy(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "keys.yaml").write_text(f"{A}: alice\n")
    policy = load_compiled(policy_with_keys(tmp_path, "sub/keys.yaml"))
    assert policy.identity.source == "api_key" and policy.identity.on_claim_mismatch == "reject"
    assert policy.identity.keys is not None and policy.identity.keys.digests() == {A: "alice"}
    assert policy.depends_on == (str(tmp_path / "sub" / "keys.yaml"),)
    keys_sha = hashlib.sha256((tmp_path / "sub" / "keys.yaml").read_bytes()).hexdigest()
    assert policy.fingerprint == f"{policy.sha256}+{keys_sha}"
    assert policy.summary().endswith(
        f"; identity api_key (1 key from {tmp_path}/sub/keys.yaml), claims rejected"
    )


def test_keys_file_problems_name_the_policy_line_that_asked_for_it(tmp_path: Path) -> None:
    policy = policy_with_keys(tmp_path)
    with pytest.raises(PolicyError) as info:
        load_compiled(policy)
    keys = tmp_path / "keys.yaml"
    assert str(info.value) == (
        f"{policy}:5:9: identity.keys: keys file {keys} is not usable\n"
        f"{keys}:1:1: <file>: cannot read: No such file or directory"
    )
    assert info.value.depends_on == (str(keys),)  # so a reloader watches for it


# -- outrate keys add / revoke -------------------------------------------------------


def test_add_prints_a_key_once_and_stores_only_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    key, digest = add_key(path, "alice")
    assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 43
    text = path.read_text()
    assert key not in text and key[len(KEY_PREFIX) :] not in text
    assert text == f'{HEADER}{digest}: "alice"\n'
    assert load_keys(path).lookup(key.encode()) == "alice"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key2, _ = add_key(path, "bob")
    assert key2 != key and load_keys(path).lookup(key2.encode()) == "bob"


def test_add_keeps_what_is_there_and_refuses_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"# ours\n{A}: alice")  # no final newline
    os.chmod(path, 0o640)
    _, digest = add_key(path, "bob")
    assert path.read_text() == f'# ours\n{A}: alice\n{digest}: "bob"\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    path.write_text(f"{A}: [\n")
    with pytest.raises(PolicyError):
        add_key(path, "carol")
    with pytest.raises(OutrateError, match="must not contain control characters"):
        add_key(tmp_path / "other.yaml", "a\nb")


def test_revoke_by_user_or_digest_keeps_comments(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"# keys\n{A}: alice\n# bob's laptop\n{B}: bob\n{C}: alice\n")
    assert revoke_keys(path, "alice") == [(A, "alice"), (C, "alice")]
    assert path.read_text() == f"# keys\n# bob's laptop\n{B}: bob\n"
    assert revoke_keys(path, B.upper().replace("SHA256", "sha256")) == [(B, "bob")]
    assert path.read_text() == "# keys\n# bob's laptop\n"
    with pytest.raises(OutrateError, match="no key of user 'bob'"):
        revoke_keys(path, "bob")


def test_revoking_the_last_key_never_leaves_a_zero_byte_file(tmp_path: Path) -> None:
    """Zero bytes reads as an edit in progress (the server keeps the old keys):
    revoking the last key must leave a file that means "no keys"."""
    path = tmp_path / "keys.yaml"
    path.write_text(f"{A}: alice\n")
    assert revoke_keys(path, "alice") == [(A, "alice")]
    assert path.read_text() == HEADER and len(load_keys(path)) == 0
    path.write_bytes(b"")  # `touch keys.yaml`, or an in-place rewrite cut short
    _, digest = add_key(path, "bob")
    assert load_keys(path).digests() == {digest: "bob"}
    path.write_bytes(b"")
    with pytest.raises(OutrateError, match="no key of user 'bob'"):
        revoke_keys(path, "bob")
    assert path.read_bytes() == b""  # nothing to revoke: not rewritten


def test_revoke_rewrites_a_flow_style_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"{{{A}: alice, {B}: bob}}\n")
    assert revoke_keys(path, "alice") == [(A, "alice")]
    assert load_keys(path).digests() == {B: "bob"}


def test_the_keys_commands(tmp_path: Path) -> None:
    runner = CliRunner()
    path = tmp_path / "keys.yaml"
    done = runner.invoke(app, ["keys", "add", "alice", "--file", str(path)])
    assert done.exit_code == 0, done.output
    key = done.stdout.strip()
    assert key.startswith(KEY_PREFIX) and "\n" not in key
    digest = key_digest(key)
    assert done.stderr == (
        f"added {digest} for 'alice' to {path}; the key above is not stored anywhere\n"
    )
    assert load_keys(path).lookup(key.encode()) == "alice"
    done = runner.invoke(app, ["keys", "revoke", digest, "--file", str(path)])
    assert (done.exit_code, done.stdout) == (0, f"revoked {digest} ('alice')\n")
    done = runner.invoke(app, ["keys", "revoke", "alice", "--file", str(path)])
    assert (done.exit_code, done.stderr) == (1, f"{path}: no key of user 'alice'\n")
    done = runner.invoke(app, ["keys", "add", "__anonymous__", "--file", str(path)])
    assert done.exit_code == 2 and "reserved" in done.stderr
    for padded in ("alice ", "alice\u00a0"):  # no request could carry it
        done = runner.invoke(app, ["keys", "add", padded, "--file", str(path)])
        assert done.exit_code == 2 and "must not begin or end with whitespace" in done.stderr
    done = runner.invoke(app, ["keys", "add", "alice"])
    assert done.exit_code == 2 and "--file" in done.stderr


def test_a_keys_file_that_cannot_be_written_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only mount (a Secret, a ConfigMap): the commands say so and exit 1."""
    import errno

    path = tmp_path / "keys.yaml"
    path.write_text(f"{A}: alice\n")

    def read_only(*_: object, **__: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("outrate.policy.keys.os.replace", read_only)
    with pytest.raises(OutrateError, match="keys.yaml: cannot write: Read-only file system"):
        add_key(path, "bob")
    with pytest.raises(OutrateError, match="keys.yaml: cannot write: Read-only file system"):
        revoke_keys(path, "alice")
    assert path.read_text() == f"{A}: alice\n"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["keys.yaml", "keys.yaml.lock"]  # no temporary file left
    monkeypatch.setattr("outrate.policy.keys.tempfile.mkstemp", read_only)
    done = CliRunner().invoke(app, ["keys", "add", "bob", "--file", str(path)])
    assert done.exit_code == 1
    assert done.stderr == f"{path}: cannot write beside it: Read-only file system\n"


# -- concurrent edits: one lock from read to rename -----------------------------------

FORK = multiprocessing.get_context("fork")


def _run_together(*jobs: tuple[Callable[..., object], tuple[object, ...]]) -> None:
    """Each job in its own process, released at once by a barrier (as `outrate
    keys` commands run from two shells or a script's `&`)."""
    barrier = FORK.Barrier(len(jobs))

    def run(job: Callable[..., object], args: tuple[object, ...]) -> None:
        barrier.wait()
        job(*args)

    procs = [FORK.Process(target=run, args=job) for job in jobs]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0


def test_parallel_adds_all_land(tmp_path: Path) -> None:
    """Unlocked, 20 parallel adds left 3 to 6 entries: each read the same file."""
    path = tmp_path / "keys.yaml"
    _run_together(*[(add_key, (path, f"user{i}")) for i in range(20)])
    users = sorted(load_keys(path).digests().values())
    assert users == sorted(f"user{i}" for i in range(20))
    assert path.read_text().startswith(HEADER) and path.read_text().count(HEADER) == 1


def test_a_revoke_beside_an_add_stays_revoked(tmp_path: Path) -> None:
    """Unlocked, the add's rename brought mallory's key back in most trials."""
    path = tmp_path / "keys.yaml"
    wrong = []
    for trial in range(20):
        path.unlink(missing_ok=True)
        add_key(path, "mallory")
        add_key(path, "alice")
        _run_together((revoke_keys, (path, "mallory")), (add_key, (path, "dave")))
        users = sorted(load_keys(path).digests().values())
        if users != ["alice", "dave"]:
            wrong.append((trial, users))
    assert wrong == []
