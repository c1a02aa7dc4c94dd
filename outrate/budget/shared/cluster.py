"""A Redis Cluster behind `redis+cluster://` (outrate.budget.shared.nodes):
`Shards`, redis-py's `RedisCluster` for the slot map and the nodes'
connection pools, and `Nodes.send` for one pipelined round trip per shard.

What is followed: MOVED (the slot map updated from the redirect, the part
resent to the new owner at once), ASK during a slot's migration (the part
resent behind ASKING), a node that stops answering (the slot map read again
with `CLUSTER SLOTS` before the next send, that node asked last). What is
told apart when the owner of a slot in use changes: a primary that now is a
replica, or gone, was failed over (counted, logged); one that still is a
primary gave its slots away (a reshard, logged).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outrate.budget.shared.nodes import Nodes
from outrate.budget.shared.url import StoreUrl


class Shards(Nodes):
    """A Redis Cluster: the slot map from redis-py's `RedisCluster`, refreshed
    after a node fails (`CLUSTER SLOTS`) and on each MOVED."""

    kind = "cluster"
    follows_moved = True

    def __init__(
        self,
        spec: StoreUrl,
        password: str | None,
        kw: dict[str, Any],
        scripts: Sequence[str],
        slots: Sequence[int],
    ):
        super().__init__(scripts)
        self.spec = spec
        self.kw = {**kw, "ssl": spec.tls}
        if password is not None:
            self.kw["password"] = password
        if spec.username:
            self.kw["username"] = spec.username
        self.slots = tuple(slots)
        """The slots this engine's keys are in (its groups and the heartbeats)."""
        self.rc: Any = None
        self._stale = True
        self._failed: str | None = None
        self._serving: dict[int, str] = {}

    def connect(self) -> None:
        """Read the slot map, then ping every primary in use."""
        self._refresh()
        for name in set(self._serving.values()):
            self.rc.nodes_manager.get_node(node_name=name).redis_connection.ping()

    def _refresh(self) -> None:
        from redis.cluster import ClusterNode, RedisCluster

        if self.rc is None:
            self.rc = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.spec.nodes],  # type: ignore[no-untyped-call]
                require_full_coverage=False,
                **self.kw,
            )
        else:
            self.rc.nodes_manager.initialize(last_failed_node_name=self._failed)
        self._stale = False
        self._failed = None
        self._seen()

    def _ready(self) -> None:
        if self._stale:
            self._refresh()

    def pool_for(self, slot: int) -> Any:
        return self.rc.nodes_manager.get_node_from_slot(slot).redis_connection.connection_pool

    def _pool_at(self, host: str, port: int) -> Any:
        from redis.cluster import ClusterNode

        nm = self.rc.nodes_manager
        node = nm.get_node(host=host, port=port)
        if node is None or node.redis_connection is None:
            node = ClusterNode(host, port)  # type: ignore[no-untyped-call]
            nm.create_redis_connections([node])
        return node.redis_connection.connection_pool

    def _moved(self, e: Any) -> None:
        """Resend to the new owner at once; read the whole slot map before
        the next send (a failover moves every slot of the shard, and only
        the full map tells a failover from a reshard)."""
        self.rc.nodes_manager.move_slot(e)
        self._stale = True

    def _sent(self, failed: list[Any]) -> None:
        if failed:
            # A node did not answer: read the slot map again before the next
            # send, asking that node last (a frozen one costs a timeout).
            self._stale = True
            where = failed[0].connection_kwargs
            self._failed = f"{where.get('host')}:{where.get('port')}"

    def _seen(self) -> None:
        """Compare who serves each slot in use with the last look: a primary
        that now is a replica, or gone, was failed over; one that still is a
        primary gave its slots away (a reshard)."""
        nm = self.rc.nodes_manager
        now: dict[int, str] = {}
        for slot in self.slots:
            nodes = nm.slots_cache.get(slot)
            if nodes:
                now[slot] = nodes[0].name
        replaced: dict[str, str] = {}
        moved: dict[str, str] = {}
        for slot, was in self._serving.items():
            new = now.get(slot)
            if new is None or new == was:
                continue
            old = nm.nodes_cache.get(was)
            if old is not None and old.server_type == "primary":
                moved[was] = new
            else:
                replaced[was] = new
        self.failovers += len(replaced)
        for was, new in sorted(replaced.items()):
            self.news.append(f"primary {was} replaced by {new}: a failover")
        for was, new in sorted(moved.items()):
            self.news.append(f"slots moved from {was} to {new}")
        self._serving = now

    def primaries(self) -> list[str]:
        return sorted(set(self._serving.values()))

    def close(self) -> None:
        if self.rc is not None:
            self.rc.close()
