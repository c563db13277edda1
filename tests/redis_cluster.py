"""Real Redis Cluster and Redis Sentinel deployments on 127.0.0.1, for failover tests.

Every process is a plain ``redis-server`` on a free port with its own temporary directory; the
helpers are context managers that kill every process and remove every directory on exit, even
when a start fails half-way. Every wait is bounded and says what it was waiting for.
Administrative commands use the synchronous redis-py client (tests run them in a thread when
the event loop must keep going, e.g. while a store write is blocked on a failover).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis
from redis_server import free_port

SERVICE = "ivrmaster"
# Sync starts at once (the 7.0 default waits 5 s for more replicas to batch with).
_COMMON = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no",
           "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]  # fmt: skip


def wait_for(what: str, check: Callable[[], bool], timeout: float, step: float = 0.05) -> float:
    """Poll ``check`` until true; the seconds it took. RuntimeError naming ``what`` on timeout."""
    started = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - started
        except (redis.RedisError, OSError):
            pass  # a node still starting or just killed: keep polling
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{what}: not true after {timeout:g} s")
        time.sleep(step)


class Node:
    """One redis-server (data node or sentinel) that can be SIGKILLed."""

    def __init__(self, root: Path, name: str, args: list[str], *, sentinel: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.dir = root / name
        self.dir.mkdir()
        self.name = name
        self.sentinel = sentinel
        log = ["--logfile", str(self.dir / "redis.log"), "--dir", str(self.dir)]
        if sentinel:  # a sentinel needs a config file it can rewrite
            conf = self.dir / "sentinel.conf"
            conf.write_text("\n".join(args) + "\n")
            self.cmd = [binary, str(conf), "--sentinel", "--port", str(self.port), *log]
        else:
            self.cmd = [binary, "--port", str(self.port), *_COMMON, *log, *args]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        wait_for(f"{self.name} on port {self.port} answers PING", self._answers, 5.0, 0.02)

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            log = self.dir / "redis.log"
            tail = log.read_text()[-800:] if log.exists() else ""
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {tail}")
        with self.client(0.5) as c:
            return bool(c.ping())

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout, decode_responses=True
        )

    def run(self, *args: Any) -> Any:
        with self.client() as c:
            return c.execute_command(*args)

    def role(self) -> str:
        with self.client() as c:
            return str(c.info("replication")["role"])

    def replica_in_sync(self) -> bool:
        with self.client() as c:
            info = c.info("replication")
        return bool(info["role"] == "slave" and info.get("master_link_status") == "up")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last words to replicas or clients."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(5)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class _Deployment:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ivr-redis-ha-"))
        self.nodes: list[Node] = []

    def _node(self, name: str, args: list[str], *, sentinel: bool = False) -> Node:
        node = Node(self.root, name, args, sentinel=sentinel)
        self.nodes.append(node)
        node.start()
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        raise NotImplementedError

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix`` from every live master (one key per DEL: a
        cluster refuses a DEL across slots)."""
        deleted = 0
        for node in self.nodes:
            if node.alive and not node.sentinel and node.role() == "master":
                with node.client() as c:
                    for key in list(c.scan_iter(match=f"{prefix}*", count=500)):
                        deleted += int(c.delete(key))
        return deleted


class ClusterProcesses(_Deployment):
    """``masters`` shards of one master and ``replicas`` replicas each, slots split evenly."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        super().__init__()
        self.masters_count = masters
        self.replicas_count = replicas
        self.node_timeout_ms = node_timeout_ms

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.masters_count])
        return f"redis+cluster://{seeds}"

    def start(self) -> None:
        total = self.masters_count * (1 + self.replicas_count)
        buses: dict[int, int] = {}
        for i in range(total):
            bus = free_port()
            args = ["--cluster-enabled", "yes", "--cluster-port", str(bus),
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms)]  # fmt: skip
            buses[self._node(f"cluster-{i}", args).port] = bus
        self._assign_slots()
        first = self.nodes[0]
        for node in self.nodes[1:]:
            first.run("CLUSTER", "MEET", "127.0.0.1", node.port, buses[node.port])
        ids = {n.port: n.run("CLUSTER", "MYID") for n in self.nodes}
        for node in self.nodes:
            wait_for(f"{node.name} knows every node", partial(self._knows, node, ids), 10.0)
        for i, replica in enumerate(self.nodes[self.masters_count :]):
            master = self.nodes[i % self.masters_count]
            replica.run("CLUSTER", "REPLICATE", ids[master.port])
        self.wait_healthy(15.0)

    def _assign_slots(self) -> None:
        per = 16384 // self.masters_count
        for i, node in enumerate(self.nodes[: self.masters_count]):
            last = 16383 if i == self.masters_count - 1 else (i + 1) * per - 1
            node.run("CLUSTER", "ADDSLOTSRANGE", i * per, last)

    def _knows(self, node: Node, ids: dict[int, str]) -> bool:
        return set(ids.values()) <= set(_cluster_nodes(node))

    def wait_healthy(self, timeout: float) -> float:
        """Every live node says the cluster is ok and every live replica is in sync."""
        return wait_for("cluster healthy", self._healthy, timeout)

    def _healthy(self) -> bool:
        for node in self.nodes:
            if not node.alive:
                continue
            if "cluster_state:ok" not in node.run("CLUSTER", "INFO"):
                return False
            if node.role() == "slave" and not node.replica_in_sync():
                return False
        return True

    def master_of_slot(self, slot: int) -> Node:
        """The live node serving ``slot`` as master, asked of any live node."""
        for asked in (n for n in self.nodes if n.alive):
            for start, end, master, *_ in asked.run("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return self._by_port(int(master[1]))
        raise RuntimeError(f"no live node knows who serves slot {slot}")

    def replicas_of(self, master: Node) -> list[Node]:
        my_id = master.run("CLUSTER", "MYID")
        found = []
        for fields in _cluster_nodes(master).values():
            if fields["master"] == my_id and "fail" not in fields["flags"]:
                found.append(self._by_port(fields["port"]))
        return [n for n in found if n.alive]

    def _by_port(self, port: int) -> Node:
        for node in self.nodes:
            if node.port == port:
                return node
        raise RuntimeError(f"port {port} is not one of this cluster's nodes")

    def wait_promoted(self, replica: Node, timeout: float) -> float:
        """Until ``replica`` is a master and the cluster is whole again."""

        def promoted() -> bool:
            return replica.role() == "master" and self._healthy()

        return wait_for(f"{replica.name} promoted to master", promoted, timeout)


def _cluster_nodes(node: Node) -> dict[str, dict[str, Any]]:
    """CLUSTER NODES of ``node`` as {id: {port, flags, master}}."""
    text = str(node.run("CLUSTER", "NODES"))
    parsed: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split("@")[0]
        port = int(address.rsplit(":", 1)[1] or 0)
        parsed[fields[0]] = {"port": port, "flags": fields[2].split(","), "master": fields[3]}
    return parsed


class SentinelProcesses(_Deployment):
    """One master, ``replicas`` replicas and ``sentinels`` sentinels (quorum 2) on ``SERVICE``."""

    def __init__(self, replicas: int = 1, sentinels: int = 3, down_after_ms: int = 1000) -> None:
        super().__init__()
        self.replicas_count = replicas
        self.sentinels_count = sentinels
        self.down_after_ms = down_after_ms
        self.sentinels: list[Node] = []
        self.data: list[Node] = []

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.sentinels)
        return f"redis+sentinel://{seeds}/{SERVICE}/0"

    def start(self) -> None:
        master = self._node("master", [])
        self.data.append(master)
        for i in range(self.replicas_count):
            args = ["--replicaof", "127.0.0.1", str(master.port)]
            self.data.append(self._node(f"replica-{i}", args))
        for i in range(self.sentinels_count):
            conf = ["bind 127.0.0.1", "sentinel resolve-hostnames no",
                    f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 2",
                    f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
                    f"sentinel failover-timeout {SERVICE} 4000",
                    f"sentinel parallel-syncs {SERVICE} 1"]  # fmt: skip
            self.sentinels.append(self._node(f"sentinel-{i}", conf, sentinel=True))
        self.wait_healthy(15.0)

    def wait_healthy(self, timeout: float) -> float:
        """Every sentinel agrees on the master, sees the others and a synced replica."""
        return wait_for("sentinel deployment healthy", self._healthy, timeout)

    def _healthy(self) -> bool:
        masters = set()
        for sentinel in self.sentinels:
            state = _pairs(sentinel.run("SENTINEL", "MASTER", SERVICE))
            if int(state["num-other-sentinels"]) < self.sentinels_count - 1:
                return False
            if int(state["num-slaves"]) < self.replicas_count or "s_down" in state["flags"]:
                return False
            masters.add(int(state["port"]))
        if len(masters) != 1:
            return False
        replicas = [n for n in self.data if n.alive and n.port not in masters]
        return all(n.replica_in_sync() for n in replicas)

    def master(self) -> Node:
        """The data node the sentinels currently name as master."""
        for sentinel in (s for s in self.sentinels if s.alive):
            _, port = sentinel.run("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            for node in self.data:
                if node.port == int(port):
                    return node
        raise RuntimeError("no sentinel names a master")

    def wait_switched(self, old: Node, timeout: float) -> float:
        """Until every sentinel names a master other than ``old`` and that node is a master."""

        def switched() -> bool:
            ports = {
                int(s.run("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])
                for s in self.sentinels
            }
            if len(ports) != 1 or old.port in ports:
                return False
            return self.master().role() == "master"

        return wait_for(f"sentinels switched away from {old.name}", switched, timeout)


def _pairs(flat: Any) -> dict[str, Any]:
    if isinstance(flat, dict):
        return {str(k): v for k, v in flat.items()}
    return {str(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
