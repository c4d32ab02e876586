"""Redis for the tests: real servers and clusters on loopback, and what runs against them.

Servers and clusters started and stopped by the tests, a server that answers a
byte at a time, engines with the Redis connector, and a Redis connector whose
lookups are followed by an eviction.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import pytest
import redis
from pytest_redis import factories
from pytest_redis.executor import RedisExecutor

from kvwire.config import EngineConfig
from kvwire.connectors.offload import RedisConnector
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from kvwire.interface.types import Request
from kvwire.media.store.redis import RedisMedium
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support import engines
from tests.support.engines import generate, tokens, with_connector

# Engines for the Redis tests: one tiny model, with and without the Redis connector.

__all__ = [
    "distinct_full_blocks",
    "distinct_prompt_blocks",
    "generate",
    "generate_with_stats",
    "shared_prefix_workload",
    "tiny_config",
    "tokens",
    "with_redis",
]

BLOCK_SIZE = 4


def tiny_config() -> EngineConfig:
    """A model and cache small enough that a whole workload runs in about a second."""
    return engines.tiny_config(block_size=BLOCK_SIZE)


UNHURRIED_REDIS = {"lookup_timeout_s": 30.0, "connect_timeout_s": 30.0}
"""Extra config for an engine test whose subject is not Redis's deadlines: at the defaults
(1 s a lookup, 2 s a connection's handshake), a server slow to answer on a loaded host
(the vLLM suite runs beside this one) is taken for down, its lookups miss or its loads
fail, and an engine that should load finds nothing (a TP=1 engine loading what a TP=2
one saved is one such: its handshake can take over 2 s there)."""


def with_redis(
    config: EngineConfig,
    url: str,
    key_prefix: str,
    *,
    kv_role: str = "kv_both",
    policy: str = "recompute",
    connector: str = "RedisConnector",
    module_path: str | None = None,
    **extra: Any,
) -> EngineConfig:
    """``config`` with a Redis connector at ``url``; ``extra`` adds extra-config keys."""
    redis_extra = {
        "url": url,
        "key_prefix": key_prefix,
        # Outage tests restart the server within milliseconds.
        "retry_interval_s": 0.001,
        "max_save_bytes_in_flight": "1MiB",
        **extra,
    }
    return with_connector(
        config, connector, redis_extra, kv_role=kv_role, policy=policy, module_path=module_path
    )


def shared_prefix_workload(
    seed: int = 3, num_requests: int = 6, shared_prefix_ratio: float = 0.7
) -> list[GenerationRequest]:
    """Prompts sharing most of a long prefix, with block-unaligned lengths."""
    spec = WorkloadSpec(
        num_requests=num_requests,
        prompt_len=30,
        output_len=5,
        shared_prefix_ratio=shared_prefix_ratio,
        vocab_size=300,
        seed=seed,
    )
    return synthetic_workload(spec)


def generate_with_stats(
    config: EngineConfig, requests: list[GenerationRequest]
) -> tuple[list[RequestOutput], dict[str, Any]]:
    """Run ``requests`` on a fresh engine; its outputs and the connector's stats of the run."""
    with LLMEngine(config) as engine:
        outputs = engine.generate(requests)
        return outputs, dict(engine.connector_stats.data)


def distinct_full_blocks(sequences: list[tuple[int, ...]], block_size: int) -> int:
    """How many different KV blocks the full blocks of the token ``sequences`` are.

    A block is identified by every token up to its end (block hashes chain),
    so a prefix common to several sequences counts once.
    """
    blocks = {
        sequence[:end]
        for sequence in sequences
        for end in range(block_size, len(sequence) + 1, block_size)
    }
    return len(blocks)


def distinct_prompt_blocks(requests: list[GenerationRequest], block_size: int) -> int:
    """How many different KV blocks an engine could load for the prompts of ``requests``.

    A prompt's last token is always computed, never loaded, so its full
    blocks are those before it.
    """
    return distinct_full_blocks([request.prompt_token_ids[:-1] for request in requests], block_size)


# A real local Redis Cluster (or Valkey cluster) for the tests: masters and replicas on loopback.
#
# :class:`LocalCluster` starts ``redis-server --cluster-enabled yes`` processes
# on free loopback ports, joins them with ``redis-cli --cluster create`` (one
# replica per master), waits, with a deadline, until every node reports
# ``cluster_state:ok`` and the same slot map, and stops every process it
# started. ``redis_cluster`` is shared by the tests that only store and load
# (each under a key prefix of its own); ``fault_cluster`` is a fresh cluster
# for one test module that kills masters or moves slots.

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


# Real redis-server (or valkey-server) processes for the Redis tests, started by pytest-redis.
#
# Two servers run on loopback, each on a free port; ``make redis-server``
# installs one where none is found, and no test skips for want of it.
# ``redis_server`` is shared by the tests that only store and load: each test
# works under a key prefix of its own. ``fault_server`` is the one tests may
# kill, restart or squeeze with ``maxmemory``; its fixture puts it back in
# order (running, no limit, empty) before and after each test.

TLS_DIR = pathlib.Path(__file__).parent / "redis_tls"


redis_server_process = factories.redis_proc(executable=SERVER_EXECUTABLE, port=None)
fault_server_process = factories.redis_proc(executable=SERVER_EXECUTABLE, port=None)


class RedisServer:
    """Controls one redis-server process started by pytest-redis."""

    def __init__(self, executor: RedisExecutor) -> None:
        self.executor = executor
        self._quiet_persistence()

    @property
    def host(self) -> str:
        return str(self.executor.host)

    @property
    def port(self) -> int:
        return int(self.executor.port)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def unix_socket(self) -> str:
        return str(self.executor.unixsocket)

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, db=0, socket_timeout=10)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no snapshot, every connection reset."""
        self.executor.kill()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP for the block: connections stay open and accepted, nothing answers.

        SIGCONT when the block ends, whatever happened in it.
        """
        process = self.executor.process
        assert process is not None and process.poll() is None
        process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Start the server again, empty, on the same port."""
        self.executor.start()
        self._quiet_persistence()

    def ensure_running(self) -> None:
        if not self.executor.running():
            self.restart()

    def cap_memory(self, headroom_bytes: int, policy: str) -> None:
        """Let the server hold ``headroom_bytes`` more than it uses now, then apply ``policy``."""
        client = self.client()
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", policy)
        client.config_set("maxmemory", used + headroom_bytes)

    def lift_memory_cap(self) -> None:
        """No memory limit again: from here on the server evicts nothing, whatever it serves."""
        client = self.client()
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", "noeviction")

    def reset(self) -> None:
        self.lift_memory_cap()
        self.client().flushall()

    def _quiet_persistence(self) -> None:
        # No snapshots: a killed server must come back empty, and disk writes
        # would only slow the tests down.
        self.client().config_set("save", "")


def wait_until_available(*stores: RedisBlockStore, timeout_s: float = 30.0) -> None:
    """Wait for the stores' background probes to find the server back (fail after the timeout)."""
    deadline = time.monotonic() + timeout_s
    while not all(store.is_available for store in stores):
        if time.monotonic() > deadline:
            raise AssertionError(f"the store did not reconnect within {timeout_s:.0f} s")
        time.sleep(0.005)


@pytest.fixture(scope="session")
def redis_server(redis_server_process: RedisExecutor) -> RedisServer:
    return RedisServer(redis_server_process)


@pytest.fixture(scope="session")
def tls_url(redis_server: RedisServer) -> str:
    """A ``rediss://`` URL: the shared server also listens with TLS (test certificates)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = redis_server.client()
    client.config_set("tls-cert-file", str(TLS_DIR / "server.crt"))
    client.config_set("tls-key-file", str(TLS_DIR / "server.key"))
    client.config_set("tls-ca-cert-file", str(TLS_DIR / "ca.crt"))
    client.config_set("tls-auth-clients", "no")
    client.config_set("tls-port", port)
    return f"rediss://127.0.0.1:{port}/0"


@pytest.fixture
def fault_server(fault_server_process: RedisExecutor) -> Iterator[RedisServer]:
    """A server the test may kill, restart or limit; restored and emptied afterwards."""
    server = RedisServer(fault_server_process)
    server.ensure_running()
    server.reset()
    yield server
    server.ensure_running()
    server.reset()


@pytest.fixture
def key_prefix() -> str:
    """A prefix of its own per test, so tests sharing a server never see each other's keys."""
    return f"kvwire-test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="module")
def workload() -> list[GenerationRequest]:
    """The shared-prefix workload the engine tests run, with and without Redis."""
    return shared_prefix_workload()


@pytest.fixture(scope="module")
def expected_tokens(workload: list[GenerationRequest]) -> list[tuple[int, ...]]:
    """The tokens of the engine without a connector: what every run must reproduce."""
    return tokens(generate(tiny_config(), workload))


@pytest.fixture
def make_redis_store(
    redis_server: RedisServer, key_prefix: str
) -> Iterator[Callable[..., RedisBlockStore]]:
    """Builds stores under this test's key prefix, on the shared server unless ``url`` says
    otherwise, with other settings as keywords; each is cleared and closed after the test."""
    stores: list[RedisBlockStore] = []

    def make(**settings: Any) -> RedisBlockStore:
        settings.setdefault("url", redis_server.url)
        # A generous lookup deadline where the deadline is not the subject: at the
        # default 1 s, a server slow to answer on a loaded host turns a lookup into a miss.
        settings.setdefault("lookup_timeout_s", 30.0)
        store = RedisBlockStore(RedisStoreSettings(key_prefix=key_prefix, **settings))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.clear()
        store.close()


@pytest.fixture
def redis_store(make_redis_store: Callable[..., RedisBlockStore]) -> RedisBlockStore:
    return make_redis_store()


# A misbehaving Redis server for the deadline tests: it answers chosen commands a byte at a time.
#
# It speaks just enough RESP for the store (the handshake, ``PING``,
# ``EXISTS``, ``SET``, ``GET``/``GETEX``, ``UNLINK``) over loopback TCP and
# keeps values in memory. A reply to a command named in ``slow`` goes out one
# byte every ``byte_interval_s``: each read on the client side succeeds well
# within its socket timeout, yet the whole reply takes minutes. That is the
# server a socket timeout alone cannot bound.


class DribblingServer:
    """A loopback RESP server whose replies to the commands in ``slow`` trickle out."""

    def __init__(self, byte_interval_s: float = 0.2) -> None:
        self.byte_interval_s = byte_interval_s
        #: Upper-case command names whose replies are sent a byte at a time.
        self.slow: set[bytes] = set()
        self.values: dict[bytes, bytes] = {}
        #: Replies the client stopped reading halfway (it closed the connection).
        self.replies_cut_off = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        # accept() wakes up this often to see whether the server is closing.
        self._listener.settimeout(0.05)
        self._connections: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._start(self._accept_all)

    @property
    def url(self) -> str:
        host, port = self._listener.getsockname()
        return f"redis://{host}:{port}/0"

    def close(self) -> None:
        """Stop answering, close every connection and wait for the server's threads."""
        self._stopped.set()
        with self._lock:
            for connection in self._connections:
                # shutdown, not close: it wakes a thread blocked reading it.
                # (OSError: the client closed it already.)
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)
            assert not thread.is_alive(), "the dribbling server did not stop"
        self._listener.close()

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_all(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            with self._lock:
                self._connections.append(connection)
            self._start(self._serve, connection)

    def _serve(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as incoming:
            try:
                for command in _commands(incoming):
                    reply = self._answer(command)
                    if command[0].upper() in self.slow:
                        self._dribble(connection, reply)
                    else:
                        connection.sendall(reply)
            except OSError:
                return  # the client went away, or the server is closing

    def _dribble(self, connection: socket.socket, reply: bytes) -> None:
        for offset in range(len(reply)):
            if self._stopped.wait(self.byte_interval_s):
                return
            try:
                connection.sendall(reply[offset : offset + 1])
            except OSError:
                with self._lock:
                    self.replies_cut_off += 1
                raise

    def _answer(self, command: list[bytes]) -> bytes:
        name, args = command[0].upper(), command[1:]
        if name == b"PING":
            return b"+PONG\r\n"
        if name in (b"CLIENT", b"SELECT"):
            return b"+OK\r\n"
        if name == b"EXISTS":
            return b":%d\r\n" % sum(key in self.values for key in args)
        if name == b"SET":
            self.values[args[0]] = args[1]
            return b"+OK\r\n"
        if name in (b"GET", b"GETEX"):
            value = self.values.get(args[0])
            return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)
        if name == b"UNLINK":
            return b":%d\r\n" % sum(self.values.pop(key, None) is not None for key in args)
        return b"-ERR unknown command '%s'\r\n" % name


def _commands(incoming: BinaryIO) -> Iterator[list[bytes]]:
    """The commands a client sends: RESP arrays of bulk strings, until it closes."""
    while True:
        header = incoming.readline()
        if not header:
            return
        command = []
        for _ in range(int(header[1:])):
            length = int(incoming.readline()[1:])
            command.append(incoming.read(length + 2)[:length])
        yield command


# A RedisConnector whose lookups are followed at once by an eviction of what they found.
#
# It stands for another client (or the server's eviction policy) removing keys
# between the scheduler's lookup and the worker's load. Loaded by module path
# (``kv_connector_module_path``), as any third-party connector would be.


class EvictingRedisConnector(RedisConnector):
    """After each lookup, deletes the last block the lookup counted from the server."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        matched, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if matched:
            first = num_computed_tokens // self.layout.block_size
            last_found = first + matched // self.layout.block_size - 1
            medium = self.medium
            assert isinstance(medium, RedisMedium)
            key = medium.store.redis_key(medium.store_key(request.block_hashes[last_found]))
            with redis.Redis.from_url(medium.settings.url) as client:
                client.delete(key)
        return matched, is_async
