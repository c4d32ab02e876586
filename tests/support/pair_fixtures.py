"""Fixtures that open connector pairs: a scheduler half and a worker half over one medium."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import pytest

from kvwire.config import EngineConfig
from kvwire.connectors.offload import SharedStorageConnector
from kvwire.interface.base import KVConnectorBase
from kvwire.registry import ConnectorRegistry
from tests.support.connector_pairs import (
    ConnectorPair,
    cache_config_for,
    engine_config,
    make_caches,
)

PairFactory = Callable[..., ConnectorPair]
OpenPair = Callable[..., ConnectorPair]


@pytest.fixture
def storage_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "kv-store"


@pytest.fixture
def open_pair() -> Iterator[OpenPair]:
    """Opens connector pairs over caches of ``seed``'s random content; shuts them all down.

    Called as ``open_pair(config, connector_class, seed, registry=None)``: each
    side is built by a container over ``registry`` (the process-wide one by default).
    """
    pairs: list[ConnectorPair] = []

    def open_one(
        config: EngineConfig,
        connector_class: type[KVConnectorBase],
        seed: int | None,
        registry: ConnectorRegistry | None = None,
    ) -> ConnectorPair:
        caches = make_caches(cache_config_for(config), seed)
        pair = ConnectorPair(config, connector_class, caches, registry=registry)
        pairs.append(pair)
        return pair

    yield open_one
    for pair in pairs:
        pair.shutdown()


@pytest.fixture
def shared_storage_pair(storage_dir: pathlib.Path, open_pair: OpenPair) -> PairFactory:
    """Builds shared-storage connector pairs on one directory."""

    def build(seed: int | None = None, **options: object) -> ConnectorPair:
        kv_role = str(options.pop("kv_role", "kv_both"))
        extra = {"shared_storage_path": str(storage_dir), "staging_buffer_bytes": "1MiB", **options}
        config: EngineConfig = engine_config("SharedStorageConnector", extra, kv_role=kv_role)
        return open_pair(config, SharedStorageConnector, seed)

    return build
