"""The built-in connectors through the kit's parallel section: two tensor-parallel ranks."""

from __future__ import annotations

import pathlib

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ParallelConformanceSuite, conformance_engine_config

pytestmark = pytest.mark.slow

# Entries of one KV head each: what a TP=1 and a TP=2 engine of the kit's model both read.
ONE_HEAD_ENTRIES = {"entry_kv_heads": 1}
SMALL_POOL = {"cpu_pool_bytes": "4MiB"}


def _shared_storage(path: pathlib.Path) -> dict[str, object]:
    return {
        "shared_storage_path": str(path),
        "max_save_bytes_in_flight": "1MiB",
        **ONE_HEAD_ENTRIES,
    }


class TestCPUOffloadConnectorAtTP2(ParallelConformanceSuite):
    # Each engine's pool lives in its worker processes: nothing outlives the engine.
    loads_across_engines = False

    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config("CPUOffloadConnector", extra_config=SMALL_POOL)


class TestSharedStorageConnectorAtTP2(ParallelConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            "SharedStorageConnector", extra_config=_shared_storage(tmp_path)
        )


class TestTieredMultiConnectorAtTP2(ParallelConformanceSuite):
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
                        "kv_connector_extra_config": _shared_storage(tmp_path),
                    },
                ]
            },
        )


class TestTieredOffloadConnectorAtTP2(ParallelConformanceSuite):
    # Written through, the tier holds every block once saved: another engine loads it,
    # each rank its own heads, brought in through that rank's pool.
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            "TieredOffloadConnector",
            extra_config={
                **SMALL_POOL,
                "write_policy": "write_through",
                "tiers": [{"medium": "directory", **_shared_storage(tmp_path)}],
            },
        )
