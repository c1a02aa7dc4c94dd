"""The keys file of `identity: {source: api_key}`: SHA-256 digests -> user ids.

    # outrate API keys (outrate keys add USER --file keys.yaml)
    sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08: alice
    sha256:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752: bob

Only digests are stored: a copy of the file (a backup, a ConfigMap, a leaked
repository) gives nobody a key. The file is read like a policy file (the same
bounded, non-blocking read and YAML limits) and every problem is located at
its line and column, so `outrate lint`, startup and a reload print the same
messages. User ids follow the identity rules of requests (`check_identity`):
an id no request can carry (`alice ` with a trailing space) is an error here.

`{}`, or a file of comments only, holds no keys: every request gets 401. A
file of zero bytes is refused instead: it is what an in-place rewrite (`>`
in a shell, an editor that truncates first) shows before its first write, and
taking it for "revoke every key" locked every client out until the write
landed. A running server's reload refuses it like any broken edit: it keeps
the last good keys and logs the refusal once (the reloader reports each
content once). At startup and in `outrate lint`, with no last keys to keep,
it is an error, with the same message: write `{}` to revoke every key.

`add_key` and `revoke_keys` are what `outrate keys add/revoke` run: they
rewrite the file through a temporary file and a rename, so the server's
watcher never reads half an edit, and they hold an exclusive `flock` on a
sibling file (`keys.yaml.lock`, left in place) from the read to the rename,
so two commands run at once both land: without it each read the same old
file and the last rename won, dropping added keys and bringing back revoked
ones. The lock orders outrate's own edits only: an editor or a script that
writes the keys file by hand does not take it, and an edit made that way
while a command runs can still be lost (run one or the other).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic_core import PydanticCustomError

from outrate.errors import OutrateError, PolicyError, Problem
from outrate.identity.core import ANONYMOUS, DIGEST_PREFIX, KeyTable, key_digest
from outrate.policy.compose import compose
from outrate.policy.file import decode_policy_bytes, read_policy_file
from outrate.policy.values import check_identity, shown

KEY_PREFIX = "ork_"
"""Generated keys start with it, so secret scanners and people recognise them."""
KEY_BYTES = 32
"""256 random bits per key."""

DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
HEADER = "# outrate API keys: sha256 digests of keys -> user ids (outrate keys add/revoke)\n"
EMPTY_FILE = (
    "empty (0 bytes), as a file being rewritten in place is before its first write: "
    "write '{}' to revoke every key (until then a running server keeps its last good keys)"
)
LOCK_SUFFIX = ".lock"


def new_key() -> str:
    """A fresh API key: `ork_` and 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def _field(key: object) -> str:
    text = str(key)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_keys(raw: bytes, source: str) -> KeyTable:
    """A keys file's bytes -> KeyTable, or a PolicyError listing every problem."""
    if not raw:  # an edit in progress, never "revoke every key": see the module docstring
        raise PolicyError([Problem(source, 1, 1, "<file>", EMPTY_FILE)])
    text = decode_policy_bytes(raw, source)
    sha = hashlib.sha256(raw).hexdigest()
    if not text.strip() or all(
        not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()
    ):
        return KeyTable((), source, sha)
    data, doc = compose(text, source)
    problems = [
        Problem(source, pos[0], pos[1], "<root>", msg.replace("duplicate key", "duplicate digest"))
        for _, pos, msg in doc.problems
    ]
    entries: list[tuple[bytes, str]] = []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(
            Problem(
                source, 1, 1, "<root>",
                f"a keys file is a mapping of 'sha256:<hex>: user id' (got {shown(data)})",
            )
        )  # fmt: skip
        data = {}
    for key, user in data.items():
        line, col = doc.keypos.get((key,), (1, 1))
        where = _field(key)
        m = DIGEST.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            problems.append(
                Problem(
                    source, line, col, where,
                    "must be 'sha256:' and 64 lowercase hex digits (the digest of a key, "
                    "never the key itself; outrate keys add writes it)",
                )
            )  # fmt: skip
            continue
        digest = bytes.fromhex(m.group(1))
        vline, vcol = doc.pos.get((key,), (line, col))
        try:
            entries.append((digest, check_identity(user)))
        except PydanticCustomError as e:
            message = e.message()
            if (e.context or {}).get("quote"):
                written = doc.written.get((key,), shown(user))
                message = f"user id must be a string; quote it: '{written}'"
            elif user == ANONYMOUS:
                message = f"'{ANONYMOUS}' is reserved for requests without identity"
            problems.append(Problem(source, vline, vcol, where, message))
    if problems:
        raise PolicyError(sorted(set(problems), key=lambda p: (p.line, p.col, p.message)))
    return KeyTable(entries, source, sha)


def load_keys(path: str | os.PathLike[str]) -> KeyTable:
    """Read and parse a keys file (bounded, regular files only)."""
    source = os.fspath(path)
    return parse_keys(read_policy_file(source), source)


# -- editing (outrate keys add / revoke) ----------------------------------------


def _current(path: Path) -> tuple[str, KeyTable]:
    """The file's text and table; a missing or zero-byte file is an empty one
    (what is written back is never zero bytes)."""
    if not path.exists() and not path.is_symlink():
        return "", KeyTable((), str(path))
    raw = read_policy_file(path)
    if not raw:
        return "", KeyTable((), str(path))
    return decode_policy_bytes(raw, str(path)), parse_keys(raw, str(path))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the exclusive lock of `path` (beside its symlink target) until the
    block ends: from the read to the rename of one `outrate keys` edit. The
    lock lives on a sibling file since the keys file itself is replaced."""
    target = path.resolve() if path.is_symlink() else path
    lock = target.with_name(target.name + LOCK_SUFFIX)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise OutrateError(f"{path}: cannot write beside it: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(path: Path, text: str) -> None:
    """Replace the file in one rename; a new file is readable by its owner only."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o600
    target = path.resolve() if path.is_symlink() else path
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as e:
        raise OutrateError(f"{path}: cannot write beside it: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OutrateError(f"{path}: cannot write: {e.strerror or e}") from e
        raise


def add_key(path: str | os.PathLike[str], user: str) -> tuple[str, str]:
    """Generate a key for `user` and append its digest: (key, digest).

    The key is returned to be shown once; it is written nowhere. Refuses a
    file that does not parse (fix it first: appending would hide the problem).
    """
    try:
        check_identity(user)
    except PydanticCustomError as e:
        raise OutrateError(f"{user!r}: {e.message()}") from None
    target = Path(path)
    with _locked(target):
        return _add(target, user)


def _add(target: Path, user: str) -> tuple[str, str]:
    text, table = _current(target)
    key = new_key()
    digest = key_digest(key)
    if digest in table.digests():  # pragma: no cover - 2**-256
        raise OutrateError("generated a key that is already listed; run again")
    if not text:
        text = HEADER
    elif not text.endswith("\n"):
        text += "\n"
    if text.strip() in ("{}",):
        text = HEADER
    _write(target, f"{text}{digest}: {_yaml_string(user)}\n")
    return key, digest


def _yaml_string(user: str) -> str:
    """A double-quoted YAML scalar (JSON's escapes are YAML's)."""
    import json

    return json.dumps(user, ensure_ascii=False)


def revoke_keys(path: str | os.PathLike[str], who: str) -> list[tuple[str, str]]:
    """Remove the entry with digest `who`, or every entry of user `who`.

    Returns the (digest, user) pairs removed. Lines of other entries and
    comments are kept; a file written in flow style (`{...}`) is rewritten
    one entry per line.
    """
    target = Path(path)
    if not target.exists():
        raise OutrateError(f"{target}: no such keys file")
    with _locked(target):
        return _revoke(target, who)


def _revoke(target: Path, who: str) -> list[tuple[str, str]]:
    text, table = _current(target)
    entries = table.digests()
    m = DIGEST.fullmatch(who.lower()) if who.lower().startswith(DIGEST_PREFIX) else None
    if m is not None:
        wanted = DIGEST_PREFIX + m.group(1)
        gone = [(d, u) for d, u in entries.items() if d == wanted]
        what = f"no key with digest {wanted}"
    else:
        gone = [(d, u) for d, u in entries.items() if u == who]
        what = f"no key of user {who!r}"
    if not gone:
        raise OutrateError(f"{target}: {what}")
    drop = {d for d, _ in gone}
    _, doc = compose(text, str(target))
    lines = text.splitlines(keepends=True)
    by_line: dict[int, list[str]] = {}
    for (key,), (line, _) in ((k, v) for k, v in doc.keypos.items() if len(k) == 1):
        by_line.setdefault(line, []).append(str(key))
    one_per_line = all(
        len(keys) == 1 and lines[line - 1].startswith(keys[0]) for line, keys in by_line.items()
    )
    if one_per_line:
        doomed = {line for line, keys in by_line.items() if keys[0] in drop}
        kept = "".join(text for i, text in enumerate(lines, 1) if i not in doomed)
        _write(target, kept or HEADER)  # never zero bytes: that is an edit in progress
    else:
        rest = [(d, u) for d, u in entries.items() if d not in drop]
        _write(target, HEADER + "".join(f"{d}: {_yaml_string(u)}\n" for d, u in rest))
    return gone
