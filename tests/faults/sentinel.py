"""A Sentinel group of real processes for the failover scenarios: one primary and two replicas
(``redis-server``, AOF on, ``appendfsync always``; two, so that the ``replicas`` durable ack still
has a replica to wait for after one is promoted) and three ``redis-server --sentinel`` watching
them with a quorum of two, all on loopback, all behind one password.

Sentinel's timing here: ``down-after-milliseconds 1000`` (a primary silent for 1 s is subjectively
down) and ``failover-timeout 5000``; production keeps Sentinel's defaults (30 s, 3 min), which the
chart's Sentinel option documents. Redis docs, "High availability with Redis Sentinel".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from infra.localstack import ManagedProcess, RedisServer, free_port
from infra.state.connect import redis_client

MASTER = "farm"
DOWN_AFTER_MS = 1000


class SentinelProcess(ManagedProcess):
    """``redis-server SENTINEL.conf --sentinel`` on 127.0.0.1:``port`` (Sentinel rewrites its
    config file, so each has its own in ``dir``)."""

    def __init__(self, port: int, primary_port: int, password: str, dir: Path, name: str, run_dir: Path):
        super().__init__(name, run_dir=run_dir)
        self.port, self.primary_port, self.password, self.dir = port, primary_port, password, dir

    def command(self) -> list[str]:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "sentinel.conf"
        conf.touch(mode=0o600)
        conf.write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}",
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary_port} 2",
            f'sentinel auth-pass {MASTER} "{self.password}"',
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER} 5000", f"sentinel parallel-syncs {MASTER} 1", ""]))
        return ["redis-server", str(conf), "--sentinel"]

    def is_ready(self) -> bool:
        import redis

        try:
            client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, decode_responses=True)
            return client.sentinel_master(MASTER).get("num-other-sentinels", 0) >= 2
        except (redis.RedisError, OSError):
            return False


class SentinelGroupServers:
    """The processes of one Sentinel group, and the farm's URL of it.

    Quacks like :class:`infra.localstack.RedisServer` where the fault farm uses one
    (:meth:`db_url`, :meth:`client`): its clients follow the primary through a failover.
    """

    def __init__(self, dir: Path, run_dir: Path, password: str = "sentinel-test-pw"):
        self.password = password
        self.primary = RedisServer(free_port(), appendonly=True, appendfsync="always", dir=dir / "a",
                                   name="redis-a", run_dir=run_dir, password=password,
                                   extra_args=["--masterauth", password])
        self.replicas = [RedisServer(free_port(), appendonly=True, appendfsync="always", dir=dir / name,
                                     name=f"redis-{name}", run_dir=run_dir, password=password,
                                     extra_args=["--masterauth", password, "--replicaof", "127.0.0.1",
                                                 str(self.primary.port)]) for name in ("b", "c")]
        self.sentinels = [SentinelProcess(free_port(), self.primary.port, password, dir / f"s{i}", f"sentinel-{i}",
                                          run_dir) for i in range(3)]

    @property
    def servers(self) -> list[RedisServer]:
        return [self.primary, *self.replicas]

    def start(self) -> "SentinelGroupServers":
        for process in (*self.servers, *self.sentinels):
            process.start()
        for process in (*self.servers, *self.sentinels):
            process.wait_ready()
        self.wait_synced()
        return self

    def stop(self) -> None:
        for process in (*self.sentinels, *self.servers):
            process.stop()

    def db_url(self, db: int) -> str:
        """The farm's URL of database ``db`` on the group's primary (``sentinel://``)."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"sentinel://:{self.password}@{hosts}/{MASTER}/{db}"

    def client(self, db: int = 0) -> Any:
        """A client of the current primary (``decode_responses=True``) that follows failovers."""
        return redis_client(self.db_url(db), socket_timeout=2, socket_connect_timeout=1)

    def primary_port(self) -> int:
        """The port of the server the sentinels now name as primary."""
        import redis

        for sentinel in self.sentinels:
            if sentinel.running:
                client = redis.Redis(host="127.0.0.1", port=sentinel.port, socket_timeout=1, decode_responses=True)
                return int(client.sentinel_get_master_addr_by_name(MASTER)[1])
        raise RuntimeError("no sentinel is running")

    def current_primary(self) -> RedisServer:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Wait until the primary has both replicas online and caught up (INFO replication)."""
        primary = self.current_primary().client()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = primary.info("replication")
            online = [info.get(f"slave{i}", {}) for i in range(2)]
            if all(r.get("state") == "online" and r.get("offset") == info["master_repl_offset"] for r in online):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the replica did not catch up in {timeout} s: {primary.info('replication')}")
