"""The built-in connectors through the conformance kit, as any third-party connector would be."""

from __future__ import annotations

import pathlib

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config

SMALL_POOL = {"cpu_pool_bytes": "4MiB"}


class TestCPUOffloadConnector(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config("CPUOffloadConnector", extra_config=SMALL_POOL)


class TestCPUOffloadConnectorAsyncLoads(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            "CPUOffloadConnector", extra_config={**SMALL_POOL, "async_load": True}
        )


class TestSharedStorageConnector(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            "SharedStorageConnector",
            extra_config={"shared_storage_path": str(tmp_path), "staging_buffer_bytes": "1MiB"},
        )


class TestSharedStorageConnectorAsyncLoads(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            "SharedStorageConnector",
            extra_config={
                "shared_storage_path": str(tmp_path),
                "staging_buffer_bytes": "1MiB",
                "async_load": True,
                "fsync": True,
            },
        )


class TestTieredMultiConnector(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            "MultiConnector",
            extra_config={
                "connectors": [
                    {
                        "kv_connector": "CPUOffloadConnector",
                        "kv_connector_extra_config": SMALL_POOL,
                    },
                    {
                        "kv_connector": "SharedStorageConnector",
                        "kv_connector_extra_config": {
                            "shared_storage_path": str(tmp_path),
                            "staging_buffer_bytes": "1MiB",
                        },
                    },
                ]
            },
        )
