"""The store's URL (`--outrate-store`): checked, redacted for logs, and
split from its password, exactly as redis-py would read it. Three forms
(`FORMS`): one server (redis-py's own URL), a Redis Cluster by its seed
nodes (`redis+cluster://`), a primary named by its Sentinels
(`redis+sentinel://`); the last two are read here (`parse_nodes`).

The password never travels with the URL (vLLM hashes and may print its
config): `split_password` takes it out, and the engine reads it from
`PASSWORD_ENV` (outrate.budget.shared.lease.RedisLink); so does the TLS key's
password (`?ssl_password=`: `split_ssl_password`, `SSL_PASSWORD_ENV`).
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import parse_qs, parse_qsl, unquote, unquote_plus, urlsplit

from outrate.env import STORE_PASSWORD, STORE_SSL_PASSWORD

PASSWORD_ENV = STORE_PASSWORD
"""Where the engine reads the store's password when the URL carries none."""
SSL_PASSWORD_ENV = STORE_SSL_PASSWORD
"""Where the engine reads the TLS private key's password (`rediss://`)."""

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


def split_ssl_password(url: str) -> tuple[str, str | None]:
    """(URL without `ssl_password`, its value or None): the TLS private key's
    password, which redis-py reads from the query of a `rediss://` URL. It
    leaves the URL like the password does (`split_password`), the first
    non-empty one kept, as redis-py keeps it."""
    parts = urlsplit(url)
    given = [v for v in parse_qs(parts.query).get("ssl_password", []) if v]
    query = "&".join(piece for piece, name in _params(parts.query) if name != "ssl_password")
    bare = f"{parts.scheme}://{parts.netloc}{parts.path}{f'?{query}' if query else ''}"
    return bare, given[0] if given else None


SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
FORMS = (
    "a redis://HOST:PORT/DB URL (rediss:// for TLS, or unix://PATH), "
    "redis+cluster://HOST:PORT[,HOST:PORT...]/ (a Redis Cluster) or "
    "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB] (a primary named by "
    "Sentinels; rediss+cluster:// and rediss+sentinel:// for TLS), each with an optional "
    "[USER]:PASSWORD@"
)


class StoreUrl(NamedTuple):
    """A cluster or Sentinel URL, read (`parse_nodes`); a plain one goes to
    redis-py's own `from_url` as it is."""

    kind: str
    """`cluster` or `sentinel`."""
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    """The cluster's seed nodes, or the Sentinels."""
    master: str | None
    """The Sentinel service name (`sentinel monitor NAME ...`)."""
    db: int
    username: str | None
    password: str | None


def _hosts(netloc: str, url: str, flag: str) -> tuple[tuple[str, int], ...]:
    out = []
    for piece in netloc.split(","):
        if piece.startswith("["):  # [IPv6]:PORT
            host, _, port = piece[1:].partition("]")
            port = port.removeprefix(":")
        else:
            host, _, port = piece.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"{flag} {redact_url(url)!r}: {piece!r} is not HOST:PORT (each node "
                "of a cluster or Sentinel URL names its port)"
            )
        out.append((host, int(port)))
    return tuple(out)


def parse_nodes(url: str, flag: str = "--outrate-store") -> StoreUrl | None:
    """The nodes of a `redis+cluster://` or `redis+sentinel://` URL (None for
    any other). Raises ValueError naming what is wrong, the URL redacted,
    after `flag` (the option it was given with)."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        return None
    userinfo, _, netloc = parts.netloc.rpartition("@")
    user, _, pw = userinfo.partition(":")
    params = dict(parse_qsl(parts.query))
    unknown = sorted(set(params) - {"password", "username"})
    if unknown:
        raise ValueError(
            f"{flag} {redact_url(url)!r}: unknown parameter {unknown[0]!r} "
            "(a cluster or Sentinel URL takes only username and password)"
        )
    username = unquote(user) or params.get("username") or None
    password = unquote(pw) if pw else params.get("password") or None
    nodes = _hosts(netloc, url, flag)
    path = [p for p in parts.path.split("/") if p]
    if scheme in CLUSTER_SCHEMES:
        if path and path != ["0"]:
            raise ValueError(f"{flag} {redact_url(url)!r}: a Redis Cluster has database 0 only")
        return StoreUrl("cluster", scheme.startswith("rediss"), nodes, None, 0, username, password)
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(
            f"{flag} {redact_url(url)!r}: a Sentinel URL names the primary "
            "it watches: redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]"
        )
    db = int(path[1]) if len(path) == 2 else 0
    return StoreUrl(
        "sentinel", scheme.startswith("rediss"), nodes, unquote(path[0]), db, username, password
    )


def check_url(url: str, flag: str = "--outrate-store") -> str:
    """Raise ValueError unless `url` is one of the store's URL forms (`FORMS`);
    the message begins with `flag` (`outrate quota --store` reads the engine's
    URLs too)."""
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        parse_nodes(url, flag)
        return url
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{flag} must be {FORMS}, got {redact_url(url)!r}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"{flag} {redact_url(url)!r} names no host")
    return url
