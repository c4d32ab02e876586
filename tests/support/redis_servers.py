"""Real redis-server (or valkey-server) processes for the Redis tests, started by pytest-redis.

Two servers run on loopback, each on a free port; ``make redis-server``
installs one where none is found, and no test skips for want of it.
``redis_server`` is shared by the tests that only store and load: each test
works under a key prefix of its own. ``fault_server`` is the one tests may
kill, restart or squeeze with ``maxmemory``; its fixture puts it back in
order (running, no limit, empty) before and after each test.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from pytest_redis import factories
from pytest_redis.executor import RedisExecutor

from kvwire.engine.engine import GenerationRequest
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.redis_engines import generate, shared_prefix_workload, tiny_config, tokens

TLS_DIR = pathlib.Path(__file__).parent / "redis_tls"

# Valkey is Redis's protocol-compatible fork: either server will do.
SERVER_EXECUTABLE = shutil.which("redis-server") or shutil.which("valkey-server")

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

    def reset(self) -> None:
        client = self.client()
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", "noeviction")
        client.flushall()

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
