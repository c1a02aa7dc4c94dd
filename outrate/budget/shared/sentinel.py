"""A primary named by its Sentinels, behind `redis+sentinel://`
(outrate.budget.shared.nodes): `Sentinels`.

redis-py's Sentinel client asks the Sentinels for the primary when it
connects, so a connection lost to a failover, or a primary that answers as a
replica (READONLY), makes the next round find the new one. That is not
enough on its own: after `SENTINEL FAILOVER` (or a partition that elected a
new primary) the old one stays up, and a primary, until its Sentinels
reconfigure it, seconds later, granting from a state the new primary never
sees. So each round asks one Sentinel in turn where the primary is, and
moves as soon as one names another node (the failover's leader knows first;
the others agree a second or two later). It never moves back to a primary
it left (`deposed`) while another is named, so Sentinels that disagree
cannot make it flip.

The Sentinels are asked without credentials (theirs are not the data
nodes'): docs/several-engines.md, "Left out".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from outrate.budget.shared.nodes import Nodes, text
from outrate.budget.shared.url import StoreUrl

DEPOSED_S = 60.0
"""How long a primary this engine moved away from is not moved back to."""


def _addr(a: Any) -> tuple[str, int]:
    return (text(a[0]), int(a[1]))


class Sentinels(Nodes):
    """The primary that the Sentinels name; followed through each failover."""

    kind = "sentinel"

    def __init__(
        self, spec: StoreUrl, password: str | None, kw: dict[str, Any], scripts: Sequence[str]
    ):
        from redis.sentinel import MasterNotFoundError, Sentinel

        super().__init__(scripts)
        assert spec.master is not None  # (parse_nodes requires it)
        self.spec = spec
        self.master = spec.master
        data = {**kw, "db": spec.db, "ssl": spec.tls}
        if password is not None:
            data["password"] = password
        if spec.username:
            data["username"] = spec.username
        self.deposed: dict[tuple[str, int], float] = {}
        """Primaries left, by address, with when (monotonic s)."""
        nodes = self

        class Following(Sentinel):
            def discover_master(self, service_name: str) -> tuple[str, int]:
                named = nodes.named()
                if not named:
                    raise MasterNotFoundError(f"no Sentinel names a primary {service_name!r}")
                fresh = [a for a in named if a not in nodes.deposed]
                return fresh[0] if fresh else named[0]

        self.sentinel: Any = Following(list(spec.nodes), sentinel_kwargs=dict(kw))  # type: ignore[no-untyped-call,unused-ignore]
        self.client = self.sentinel.master_for(self.master, **data)  # type: ignore[no-untyped-call,unused-ignore]
        self.primary: str | None = None
        self._turn = 0

    def named(self) -> list[tuple[str, int]]:
        """What each Sentinel that answers names as the primary (at connect)."""
        out = []
        for s in self.sentinel.sentinels:
            try:
                addr = s.sentinel_get_master_addr_by_name(self.master)
            except Exception:
                continue
            if addr:
                out.append(_addr(addr))
        return out

    def connect(self) -> None:
        self.client.ping()
        self._sent([])

    def _ready(self) -> None:
        pool = self.client.connection_pool
        used = pool.master_address
        sentinels = self.sentinel.sentinels
        if used is None or not sentinels:
            return
        self._turn = (self._turn + 1) % len(sentinels)
        try:
            addr = sentinels[self._turn].sentinel_get_master_addr_by_name(self.master)
        except Exception:
            return  # that Sentinel is down: another is asked next round
        now = time.monotonic()
        for a, t in list(self.deposed.items()):
            if now - t > DEPOSED_S:
                del self.deposed[a]
        if addr and _addr(addr) != _addr(used) and _addr(addr) not in self.deposed:
            self.deposed[_addr(used)] = now
            pool.disconnect()  # reconnects to the primary the Sentinels name now

    def pool_for(self, slot: int) -> Any:
        return self.client.connection_pool

    def _sent(self, failed: list[Any]) -> None:
        addr = self.client.connection_pool.master_address
        if addr is None:
            return
        now = f"{text(addr[0])}:{int(addr[1])}"
        if self.primary is not None and now != self.primary:
            self.failovers += 1
            self.news.append(
                f"primary of {self.master!r} is now {now} (was {self.primary}): a failover"
            )
        self.primary = now

    def primaries(self) -> list[str]:
        return [self.primary] if self.primary else []

    def close(self) -> None:
        self.client.close()
        for s in self.sentinel.sentinels:
            s.close()
