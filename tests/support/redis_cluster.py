"""A real local Redis Cluster (or Valkey cluster) for the tests: masters and replicas on loopback.

:class:`LocalCluster` starts ``redis-server --cluster-enabled yes`` processes
on free loopback ports, joins them with ``redis-cli --cluster create`` (one
replica per master), waits, with a deadline, until every node reports
``cluster_state:ok`` and the same slot map, and stops every process it
started. ``redis_cluster`` is shared by the tests that only store and load
(each under a key prefix of its own); ``fault_cluster`` is a fresh cluster
for one test module that kills masters or moves slots.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator

import pytest
import redis

# Valkey's cluster speaks the same protocol: either server will do.
SERVER_EXECUTABLE = shutil.which("redis-server") or shutil.which("valkey-server")
CLI_EXECUTABLE = shutil.which("redis-cli") or shutil.which("valkey-cli")

# How long a master may be silent before its replica takes over: short, so
# a failover test waits about a second, not the default 15.
NODE_TIMEOUT_MS = 500
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0
# A node's cluster bus listens on its port + 10000.
_BUS_PORT_OFFSET = 10000


class ClusterNode:
    """One redis-server process of the local cluster."""

    def __init__(self, port: int, directory: pathlib.Path) -> None:
        self.port = port
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": str(NODE_TIMEOUT_MS),
            # Nothing on disk: a killed node comes back empty, and fast.
            "save": "",
            "appendonly": "no",
            # A replica syncs at once (the default waits 5 s for more replicas).
            "repl-diskless-sync-delay": "0",
            "dir": str(self.directory),
        }
        arguments = [str(SERVER_EXECUTABLE)]
        for name, value in options.items():
            arguments += [f"--{name}", value]
        self.process = subprocess.Popen(
            arguments,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, every connection reset."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=_STOP_TIMEOUT_S)

    def pause(self) -> None:
        """SIGSTOP: the node hangs, connections stay open and nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """:meth:`pause` for the block, :meth:`resume` when it ends, whatever happened in it."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        self.wait_stopped()

    def wait_stopped(self) -> None:
        assert self.process is not None
        try:
            self.process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def info(self) -> dict[str, str]:
        text = self.client().execute_command("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def role(self) -> str:
        return str(self.client().info("replication")["role"])


class LocalCluster:
    """``masters`` masters, each with ``replicas_per_master`` replicas, on loopback."""

    def __init__(
        self, directory: pathlib.Path, *, masters: int = 3, replicas_per_master: int = 1
    ) -> None:
        count = masters * (1 + replicas_per_master)
        self.replicas_per_master = replicas_per_master
        self.nodes = [
            ClusterNode(port, directory / str(port)) for port in _free_cluster_ports(count)
        ]

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming every node as a seed."""
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def start(self) -> None:
        if SERVER_EXECUTABLE is None or CLI_EXECUTABLE is None:
            raise RuntimeError("redis-server and redis-cli are needed: run `make redis-server`")
        for node in self.nodes:
            node.start()
        self._wait(lambda: all(_answers(node) for node in self.nodes), "nodes to answer PING")
        create = [
            str(CLI_EXECUTABLE),
            "--cluster",
            "create",
            *(node.address for node in self.nodes),
            "--cluster-replicas",
            str(self.replicas_per_master),
            "--cluster-yes",
        ]
        subprocess.run(create, check=True, capture_output=True, timeout=_START_TIMEOUT_S)
        self.wait_until_healthy()

    def stop(self) -> None:
        # SIGTERM to all first: the nodes shut down side by side.
        for node in self.nodes:
            if node.running:
                assert node.process is not None
                node.process.terminate()
        for node in self.nodes:
            if node.process is not None:
                node.wait_stopped()

    def masters(self) -> list[ClusterNode]:
        """The running nodes that serve slots now (after a failover, a promoted replica)."""
        return [node for node in self.nodes if node.running and node.role() == "master"]

    def node_of_key(self, name: str) -> ClusterNode:
        """The master serving ``name``'s slot now."""
        asked = self.masters()[0]
        slot = int(asked.client().execute_command("CLUSTER", "KEYSLOT", name))
        owner = next(address for start, end, address in _slot_owners(asked) if start <= slot <= end)
        return next(node for node in self.nodes if node.address == owner)

    def rejoin(self, node: ClusterNode) -> None:
        """Start a killed node again: its nodes.conf makes it a replica of whoever took over."""
        node.start()
        self._wait(lambda: _answers(node), f"{node.address} to answer PING")
        self.wait_until_healthy()

    def move_keys_slots(
        self, source: ClusterNode, target: ClusterNode, names: Iterable[str]
    ) -> int:
        """Move the slots of the keys ``names`` (keys ``source`` holds) to ``target``, keys and all.

        Redis Cluster's resharding, step by step (as ``redis-cli --cluster
        reshard`` does it): mark each slot importing and migrating, MIGRATE its
        keys, then give it to ``target`` on every master. How many slots moved.
        """
        source_client, target_client = source.client(), target.client()
        source_id = source_client.execute_command("CLUSTER", "MYID")
        target_id = target_client.execute_command("CLUSTER", "MYID")
        slots = {int(source_client.execute_command("CLUSTER", "KEYSLOT", name)) for name in names}
        for slot in slots:
            target_client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            source_client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            while names := source_client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                source_client.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *names
                )
            for node in self.masters():
                node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self.wait_until_healthy()
        return len(slots)

    def wait_until_healthy(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Until every running node says ``cluster_state:ok``, every replica is in sync with
        its master, and all agree on the slot owners."""

        def healthy() -> bool:
            running = [node for node in self.nodes if node.running]
            try:
                if any(node.info().get("cluster_state") != "ok" for node in running):
                    return False
                # Every replica has synced with its master: it could take over.
                replication = [node.client().info("replication") for node in running]
                if any(
                    info["role"] == "slave" and info.get("master_link_status") != "up"
                    for info in replication
                ):
                    return False
                maps = {_slot_owners(node) for node in running}
            except redis.RedisError:
                return False
            return len(maps) == 1

        self._wait(healthy, "the cluster to be healthy", timeout_s)

    def _wait(self, condition: object, what: str, timeout_s: float = _START_TIMEOUT_S) -> None:
        assert callable(condition)
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.02)


def _answers(node: ClusterNode) -> bool:
    try:
        return bool(node.client().ping())
    except redis.RedisError:
        return False


def _slot_owners(node: ClusterNode) -> frozenset[tuple[int, int, str]]:
    """Each slot range and the address of the master serving it, as ``node`` sees them."""
    owners = set()
    for start, end, master, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
        host, port = master[0], master[1]
        host = host.decode() if isinstance(host, bytes) else host
        owners.add((int(start), int(end), f"{host}:{port}"))
    return frozenset(owners)


def _free_cluster_ports(count: int) -> list[int]:
    """``count`` loopback ports free now, each with its cluster bus port (+10000) free too."""
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        while len(ports) < count:
            probe = held.enter_context(socket.socket())
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
            if port + _BUS_PORT_OFFSET > 65535 or not _is_free(port + _BUS_PORT_OFFSET):
                continue
            ports.append(port)
    return ports


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def running_cluster(directory: pathlib.Path, *, masters: int = 3) -> Iterator[LocalCluster]:
    """A started cluster, stopped (every process) when the block ends, whatever happened."""
    cluster = LocalCluster(directory, masters=masters)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster of 3 masters and 3 replicas shared by the tests that only store and load."""
    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def fault_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster of its own for one module's tests that kill masters or move slots."""
    with running_cluster(tmp_path_factory.mktemp("fault-cluster")) as cluster:
        yield cluster
