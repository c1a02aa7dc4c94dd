"""Which nodes a store URL names (`open_nodes`): one Redis server
(outrate.budget.shared.nodes.Server), the primary its Sentinels name
(outrate.budget.shared.sentinel), or the shards of a Redis Cluster
(outrate.budget.shared.cluster). Kept apart from the three so that each
imports the base class below it and nothing imports back up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outrate.budget.shared.cluster import Shards
from outrate.budget.shared.nodes import Nodes, Server
from outrate.budget.shared.sentinel import Sentinels
from outrate.budget.shared.url import parse_nodes


def open_nodes(
    url: str,
    password: str | None,
    timeout_s: float,
    scripts: Sequence[str],
    slots: Sequence[int],
    ssl_password: str | None = None,
) -> Nodes:
    """The nodes behind a store URL (`url`'s own password first). Timeouts
    are short and no client retries on its own: a failed round trip is
    retried by the next lease round. `ssl_password` (the TLS key's) goes to
    a `rediss://` server only: cluster and Sentinel URLs take no TLS
    settings (outrate.budget.shared.url.parse_nodes)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    spec = parse_nodes(url)
    if spec is None:
        if ssl_password is not None and url.startswith("rediss://"):
            kw["ssl_password"] = ssl_password
        return Server(url, password, kw, scripts)
    password = spec.password or password
    if spec.kind == "sentinel":
        return Sentinels(spec, password, kw, scripts)
    return Shards(spec, password, kw, scripts, slots)
