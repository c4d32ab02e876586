"""The container under concurrency: one connector per role and one engine_id, whatever the race.

Each test starts its threads together on a ``threading.Barrier``; the
connector under test sleeps in its constructor (as a network connect would),
so without a lock every thread would build its own.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from dependency_injector import providers, resources

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.container import (
    ConnectorBuildTimeout,
    KVConnectorContainer,
    ThreadSafeResource,
    declare_role,
)
from kvwire.interface.base import KVConnectorRole
from kvwire.registry import ConnectorRegistry
from tests.support.connectors import RecordingConnector

THREADS = 8
DEADLINE_S = 30.0

T = TypeVar("T")


class SlowConnector(RecordingConnector):
    """Sleeps in its constructor, releasing the GIL, and counts every instance built."""

    built: list[SlowConnector] = []
    built_lock = threading.Lock()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.05)
        super().__init__(*args, **kwargs)
        with SlowConnector.built_lock:
            SlowConnector.built.append(self)


@pytest.fixture(autouse=True)
def fresh_count() -> Iterator[None]:
    SlowConnector.built = []
    yield
    SlowConnector.built = []


def together(call: Callable[[], T], threads: int = THREADS) -> list[T]:
    """``call()`` in ``threads`` threads released at once; every answer, or the first error."""
    barrier = threading.Barrier(threads, timeout=DEADLINE_S)

    def run() -> T:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(run) for _ in range(threads)]
        return [future.result(timeout=DEADLINE_S) for future in futures]


@pytest.fixture
def slow_container(
    registry: ConnectorRegistry,
    make_engine_config: Callable[..., EngineConfig],
    kv_cache_config: KVCacheConfig,
) -> Iterator[Any]:
    container = KVConnectorContainer()
    container.registry.override(providers.Object(registry))
    container.engine_config.override(providers.Object(make_engine_config("RecordingConnector")))
    container.kv_cache_config.override(providers.Object(kv_cache_config))
    container.connector_class.override(providers.Object(SlowConnector))
    yield container
    container.shutdown_resources()


def test_racing_threads_get_one_worker_connector(slow_container: Any) -> None:
    connectors = together(slow_container.worker_connector)

    assert len(SlowConnector.built) == 1
    assert all(connector is SlowConnector.built[0] for connector in connectors)


def test_racing_threads_get_one_process_connector(slow_container: Any) -> None:
    declare_role(slow_container, KVConnectorRole.SCHEDULER)

    connectors = together(slow_container.connector)

    assert len(SlowConnector.built) == 1
    assert {id(connector) for connector in connectors} == {id(SlowConnector.built[0])}


def test_both_roles_built_at_once_get_one_connector_each(slow_container: Any) -> None:
    roles = [slow_container.scheduler_connector, slow_container.worker_connector]
    turn = iter(range(THREADS))
    turn_lock = threading.Lock()

    def either_role() -> Any:
        with turn_lock:
            index = next(turn)
        return roles[index % 2]()

    connectors = together(either_role)

    assert len(SlowConnector.built) == 2
    assert {connector.role for connector in connectors} == set(KVConnectorRole)
    assert len({id(connector) for connector in connectors}) == 2


def test_every_connector_built_in_a_race_is_shut_down_once(slow_container: Any) -> None:
    together(slow_container.worker_connector)

    slow_container.shutdown_resources()

    assert [connector.shutdown_count for connector in SlowConnector.built] == [1]


def test_an_override_still_wins_over_the_locked_provider(slow_container: Any) -> None:
    replacement = object()

    with slow_container.worker_connector.override(providers.Object(replacement)):
        answers = together(slow_container.worker_connector)

    assert all(answer is replacement for answer in answers)
    assert SlowConnector.built == []


def test_a_failed_build_is_retried_by_the_next_caller(slow_container: Any) -> None:
    with (
        slow_container.kv_cache_config.override(providers.Object(None)),
        pytest.raises(Exception, match="is not an instance of"),
    ):
        slow_container.worker_connector()

    assert slow_container.worker_connector() is SlowConnector.built[0]


class BlockedUntilReleased(resources.Resource[str]):
    """A resource whose construction blocks until the test lets it go."""

    started = threading.Event()
    release = threading.Event()

    def init(self) -> str:
        BlockedUntilReleased.started.set()
        assert BlockedUntilReleased.release.wait(DEADLINE_S)
        return "built"


class ImpatientResource(ThreadSafeResource[str]):
    build_wait_s = 0.01


def test_a_caller_waits_for_another_thread_s_build_no_longer_than_the_deadline() -> None:
    provider = ImpatientResource(BlockedUntilReleased)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(provider)
        assert BlockedUntilReleased.started.wait(DEADLINE_S)
        try:
            with pytest.raises(ConnectorBuildTimeout) as caught:
                provider()
        finally:
            BlockedUntilReleased.release.set()
        assert first.result(timeout=DEADLINE_S) == "built"

    assert str(caught.value) == (
        "Another thread has been building this connector for more than 0.01 s; "
        "its constructor is stuck (a connect or an allocation without a deadline?)"
    )
    assert provider() == "built"
    provider.shutdown()


# ------------------------------------------------------------- engine_id


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    # The race on the profile cache is a few microseconds wide: switch threads
    # often enough that it is hit on every run without the fix.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


@pytest.mark.usefixtures("frequent_thread_switches")
def test_racing_threads_share_one_engine_id_from_a_profile_mapping(
    registry: ConnectorRegistry,
) -> None:
    for _ in range(20):
        container = KVConnectorContainer()
        container.registry.override(providers.Object(registry))
        container.config.from_dict(
            {"kv_transfer_config": {"kv_connector": "RecordingConnector", "kv_role": "kv_both"}}
        )

        configs = together(container.engine_config)

        assert len({config.kv_transfer_config.engine_id for config in configs}) == 1
