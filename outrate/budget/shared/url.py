"""The store's URL (`--outrate-store`): checked, redacted for logs, and
split from its password, exactly as redis-py would read it.

The password never travels with the URL (vLLM hashes and may print its
config): `split_password` takes it out, and the engine reads it from
`PASSWORD_ENV` (outrate.budget.shared.lease.RedisLink).
"""

from __future__ import annotations

from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

from outrate.env import STORE_PASSWORD

PASSWORD_ENV = STORE_PASSWORD
"""Where the engine reads the store's password when the URL carries none."""

SECRET_PARAMS = ("password", "username")
"""Query parameters redis-py reads as credentials (`parse_url`), beside the
userinfo; any other parameter named `*password` (`ssl_password`) is one too."""


def _params(query: str) -> list[tuple[str, str]]:
    """(piece, name) of each `name=value` of a URL's query, its name decoded
    as redis-py's `parse_qs` decodes it (`pass%77ord` is `password`). Pieces
    without `=` are left out: redis-py ignores them, and one may be the tail
    of a password with an unescaped `&`."""
    out = []
    for piece in query.split("&") if query else ():
        name, eq, _ = piece.partition("=")
        if eq:
            out.append((piece, unquote_plus(name)))
    return out


def _secret(name: str) -> bool:
    return name in SECRET_PARAMS or name.endswith("password")


def redact_url(url: str) -> str:
    """The URL with every credential redis-py would read in it replaced by
    `***`: safe for logs. The userinfo (`user:pw@`, `:pw@`, `user@`) and the
    credential query parameters (`?password=`, `?username=`), percent-encoded
    or not; the fragment, which redis-py ignores, is dropped. A URL that
    still has an `@` after its host (a password with an unescaped `/`, `?`
    or `#`, whose tail landed in the path or the query) shows its scheme only."""
    parts = urlsplit(url)
    _, at, host = parts.netloc.rpartition("@")
    params = _params(parts.query)
    secret = {piece for piece, name in params if _secret(name)}
    shown = [piece for piece in parts.query.split("&") if piece not in secret]
    if "@" in parts.path + parts.fragment + "&".join(shown):
        return f"{parts.scheme}://***"
    query = "&".join(f"{p.partition('=')[0]}=***" if p in secret else p for p, _ in params)
    return f"{parts.scheme}://{'***@' if at else ''}{host}{parts.path}" + (
        f"?{query}" if query else ""
    )


def split_password(url: str) -> tuple[str, str | None]:
    """(URL without its password, the password or None). The password is the
    one redis-py would use: the userinfo's, else the first non-empty
    `password` query parameter; every `password` parameter leaves the URL,
    so the URL that travels on (vLLM's config, the engine's settings) never
    carries one. The username stays, where it was."""
    parts = urlsplit(url)
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    params = _params(parts.query)
    password = unquote(parts.password) if parts.password else None
    if password is None:
        given = parse_qs(parts.query).get("password")
        password = given[0] if given else None
    query = "&".join(piece for piece, name in params if name != "password")
    netloc = f"{user}@{host}" if user else host
    return f"{parts.scheme}://{netloc}{parts.path}{f'?{query}' if query else ''}", password


def check_url(url: str) -> str:
    """Raise ValueError unless `url` is a redis:// or rediss:// URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"--outrate-store must be a redis://HOST:PORT/DB, rediss:// (TLS) or unix:// URL, "
            f"got {redact_url(url)!r}"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"--outrate-store {redact_url(url)!r} names no host")
    return url
