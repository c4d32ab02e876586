"""Fixtures of the connectors' tests."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import pytest

from kvwire.config import EngineConfig
from kvwire.connectors.shared_storage import SharedStorageConnector
from tests.connectors.harness import ConnectorPair, cache_config_for, engine_config, make_caches

PairFactory = Callable[..., ConnectorPair]


@pytest.fixture
def storage_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "kv-store"


@pytest.fixture
def shared_storage_pair(storage_dir: pathlib.Path) -> Iterator[PairFactory]:
    """Builds shared-storage connector pairs on one directory; shuts them all down."""
    pairs: list[ConnectorPair] = []

    def build(seed: int | None = None, **options: object) -> ConnectorPair:
        kv_role = str(options.pop("kv_role", "kv_both"))
        extra = {"shared_storage_path": str(storage_dir), "staging_buffer_bytes": "1MiB", **options}
        config: EngineConfig = engine_config("SharedStorageConnector", extra, kv_role=kv_role)
        pair = ConnectorPair(
            config, SharedStorageConnector, make_caches(cache_config_for(config), seed)
        )
        pairs.append(pair)
        return pair

    yield build
    for pair in pairs:
        pair.shutdown()
