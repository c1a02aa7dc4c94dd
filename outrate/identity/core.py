"""Who a request belongs to, and the rules every identity follows.

Where the user id comes from is the policy's `identity:` section (compiled
into `IdentityConfig`): the request body's `vllm_xargs.output_rate_user`
(`body`, trusted as sent), a header a trusted gateway sets (`header`), or an
API key looked up by its SHA-256 digest (`api_key`, `KeyTable`). The API
server decides once per request and signs its answer into the request
(`Stamper`); with a source other than body the engine trusts only that
signature, never a field of the body.

The API layer refuses a bad identity with HTTP 400 before it reaches the
engine (`identity_error`); the engine never trusts that happened and maps
anything invalid to the anonymous budget (`resolve_identity`), so a bad value
can neither crash the engine nor escape every limit.

`text_error` is the one rule for the characters of every name a policy or a
request carries (user ids, tier names, patterns): no characters a reader
cannot see. Control characters (Cc) end log lines and spoof terminals; format
characters (Cf: bidi overrides such as U+202E, zero-width marks such as
U+200B) make two different ids look the same; line and paragraph separators
(Zl, Zp) split log lines; lone surrogates (Cs) cannot be encoded at all.

`padding_error` is the rule an identity adds: no whitespace at either end.
`alice ` and `alice\u00a0` (NBSP, a space separator, Zs) read as `alice` in
every log and dashboard, yet would be charged as two more users at the
default rate. Headers lose their optional whitespace (SP, HTAB; RFC 9110
section 5.5) before the rule runs, so a gateway's `alice   ` is alice; what
is left at an end is refused, from every source (header, body, keys file).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from outrate.env import IDENTITY_SECRET, Env

IDENTITY_KEY = "output_rate_user"
"""The `vllm_xargs` key (and `SamplingParams.extra_args` key) that names the user."""

ANONYMOUS = "__anonymous__"
"""The user id of requests that carry no identity; they share one budget."""

IDENTITY_FIELD = f"vllm_xargs.{IDENTITY_KEY}"

MAX_IDENTITY_LEN = 256
"""Also the length limit of every name in a policy (user ids, tiers, patterns)."""

_INVISIBLE = {
    "Cc": "control characters",
    "Cf": "format characters",
    "Zl": "line separators",
    "Zp": "paragraph separators",
    "Cs": "surrogates",
}


def text_error(text: str) -> str | None:
    """Why `text` is unfit as a name (`must not contain ...`), or None.

    Names the first offending character by code point, since it is invisible.
    """
    if text.isascii():  # the common case: only C0 controls and DEL are Cc
        for i, c in enumerate(text):
            if c < " " or c == "\x7f":
                return f"must not contain control characters (U+{ord(c):04X} at index {i})"
        return None
    for i, c in enumerate(text):
        what = _INVISIBLE.get(unicodedata.category(c))
        if what is not None:
            return f"must not contain {what} (U+{ord(c):04X} at index {i})"
    return None


def padding_error(text: str) -> str | None:
    """Why `text` is unfit as an identity for whitespace at an end, or None.

    Whitespace is what `str.isspace` says: the ASCII blanks and every Unicode
    space separator (Zs: NBSP, U+2000-U+200A, U+3000, ...)."""
    for i in (0, len(text) - 1) if text else ():
        if text[i].isspace():
            return f"must not begin or end with whitespace (U+{ord(text[i]):04X} at index {i})"
    return None


def identity_error(value: Any, field: str = IDENTITY_FIELD) -> str | None:
    """Why `value` is not a usable identity, or None when it is.

    `field` names where the request carried it (`sampling_params.extra_args.
    output_rate_user` on vLLM's token-in route)."""
    if not isinstance(value, str):
        return f"{field} must be a string, got {_json_type(value)}"
    if not value:
        return f"{field} must not be empty"
    if len(value) > MAX_IDENTITY_LEN:
        return f"{field} must be at most {MAX_IDENTITY_LEN} characters, got {len(value)}"
    bad = text_error(value) or padding_error(value)
    if bad is not None:
        return f"{field} {bad}"
    if value == ANONYMOUS:
        return f"{field} must not be the reserved id {ANONYMOUS!r}"
    return None


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, as the client wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def resolve_identity(
    sampling_params: Any,
    logger: logging.Logger | None = None,
    source: str = "body",
    stamper: Stamper | None = None,
) -> str:
    """The user id of a request inside the engine; never raises.

    With `source` body (the default) the request's own claim counts. With any
    other source only the API server's stamp does (`STAMP_KEY`, verified with
    `stamper`): a body field is never trusted, so a request that reached the
    engine without passing the API server's gate is anonymous.
    """
    extra = getattr(sampling_params, "extra_args", None)
    if not extra:
        return ANONYMOUS
    try:
        value = extra.get(STAMP_KEY if source != "body" else IDENTITY_KEY)
    except AttributeError:
        return ANONYMOUS
    if source != "body":
        user = stamper.verify(value) if stamper is not None else None
        if user is None:
            if logger is not None and (value is not None or IDENTITY_KEY in extra):
                logger.warning(
                    "outrate: identity.source is %s and this request carries no identity "
                    "verified by the API server; request counted in the anonymous budget",
                    source,
                )
            return ANONYMOUS
        value = user
    if value is None:
        return ANONYMOUS
    error = identity_error(value)
    if error is None:
        return str(value)
    if logger is not None:
        logger.warning("outrate: %s; request counted in the anonymous budget", error)
    return ANONYMOUS


# -- where the identity comes from (the policy's `identity:` section) ---------

SOURCES = ("body", "header", "api_key")
"""`body`: the request's own claim (trusted); `header`: a header a trusted
gateway sets; `api_key`: `Authorization: Bearer KEY`, looked up in a keys file."""

ON_CLAIM_MISMATCH = ("reject", "ignore")

DIGEST_PREFIX = "sha256:"


class KeyTable:
    """SHA-256 digests of API keys -> user ids. Keys themselves are never held.

    `lookup` hashes the presented key and compares its digest with *every*
    entry with `hmac.compare_digest`, without stopping at a match: how long it
    takes depends on the number of entries, never on how many leading
    characters (of the key or of its digest) match one. A dict keyed by digest
    would answer in O(1) but compare bytes with an early exit.
    """

    __slots__ = ("_entries", "source", "sha256")

    def __init__(
        self, entries: Iterable[tuple[bytes, str]] = (), source: str = "", sha256: str = ""
    ) -> None:
        self._entries: tuple[tuple[bytes, str], ...] = tuple(entries)
        self.source = source
        """The keys file, as the policy resolved it."""
        self.sha256 = sha256
        """Hex digest of the file's bytes (what the reloader compares)."""

    def lookup(self, key: bytes) -> str | None:
        """The user whose key this is, or None."""
        presented = hashlib.sha256(key).digest()
        found: str | None = None
        for digest, user in self._entries:
            if hmac.compare_digest(digest, presented):
                found = user
        return found

    def __len__(self) -> int:
        return len(self._entries)

    def digests(self) -> dict[str, str]:
        """`sha256:<hex>` -> user id, for lint, reload logs and `outrate keys`."""
        return {DIGEST_PREFIX + d.hex(): user for d, user in self._entries}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyTable):
            return NotImplemented
        return sorted(self._entries) == sorted(other._entries)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:  # never the digests: a repr ends up in logs
        return f"KeyTable({len(self)} keys from {self.source or '<memory>'})"


def key_digest(key: str | bytes) -> str:
    """`sha256:<hex>` of an API key, as the keys file stores it."""
    raw = key.encode() if isinstance(key, str) else key
    return DIGEST_PREFIX + hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True, slots=True)
class IdentityConfig:
    """The compiled `identity:` section: how the API server learns the user."""

    source: str = "body"
    header: str | None = None
    """With source header: the header's name, lower case (ASGI's spelling)."""
    on_claim_mismatch: str = "reject"
    keys: KeyTable | None = None
    """With source api_key: the keys file's table (None: not loaded, no key is valid)."""

    @property
    def keys_file(self) -> str | None:
        return self.keys.source if self.keys is not None else None

    def describe(self) -> str:
        """One phrase for logs: `api_key (3 keys from /etc/outrate/keys.yaml)`."""
        claims = "claims rejected" if self.on_claim_mismatch == "reject" else "claims ignored"
        if self.source == "header":
            return f"header {self.header!r}, {claims}"
        if self.source == "api_key":
            n = len(self.keys) if self.keys is not None else 0
            where = f" from {self.keys_file}" if self.keys_file else ""
            return f"api_key ({n} key{'' if n == 1 else 's'}{where}), {claims}"
        return "body (vllm_xargs.output_rate_user, trusted as sent)"


BODY = IdentityConfig()


# -- carrying the API server's decision to the engine -------------------------

STAMP_KEY = "output_rate_identity"
"""`SamplingParams.extra_args` key the API server writes: `<hmac>:<user>`.
The engine trusts it only with a valid MAC, so a client that writes it
itself (it can: vllm_xargs become extra_args) gains nothing."""

SECRET_ENV = IDENTITY_SECRET
"""Hex secret shared by the API server(s) and the engine core: set at startup
by the plugin when unset, inherited by the processes vLLM starts."""

_STAMP_CONTEXT = b"outrate identity v1\x00"


class Stamper:
    """Signs the user the API server resolved; the engine verifies it."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the identity secret must be at least 16 bytes")
        self._secret = secret

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Stamper | None:
        raw = Env.read(environ).identity_secret
        try:
            return cls(bytes.fromhex(raw)) if raw else None
        except ValueError:
            return None

    def _mac(self, user: str) -> str:
        data = _STAMP_CONTEXT + user.encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, data, hashlib.sha256).hexdigest()

    def sign(self, user: str) -> str:
        return f"{self._mac(user)}:{user}"

    def verify(self, stamp: object) -> str | None:
        """The user a stamp carries, if this process's secret signed it."""
        if not isinstance(stamp, str):
            return None
        mac, sep, user = stamp.partition(":")
        expected = self._mac(user).encode()
        if not sep or not hmac.compare_digest(mac.encode("utf-8", "replace"), expected):
            return None
        return user

    def __repr__(self) -> str:
        return "Stamper(<secret>)"
