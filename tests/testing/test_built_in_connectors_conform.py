"""The built-in connectors through the conformance kit, as any third-party connector would be."""

from __future__ import annotations

import pathlib

import attrs
import pytest

from kvwire.config import EngineConfig
from kvwire.engine import GenerationRequest
from kvwire.testing import ConnectorConformanceSuite, Instruments, conformance_engine_config

SMALL_POOL = {"cpu_pool_bytes": "4MiB"}
# Each connector runs the suite with loads in the forward pass and in the background.
LOAD_MODES = [pytest.param(False, id="sync-loads"), pytest.param(True, id="async-loads")]


class TestCPUOffloadConnector(ConnectorConformanceSuite):
    @pytest.fixture(params=LOAD_MODES)
    def engine_config(self, request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            "CPUOffloadConnector", extra_config={**SMALL_POOL, "async_load": request.param}
        )


class TestSharedStorageConnector(ConnectorConformanceSuite):
    @pytest.fixture(params=LOAD_MODES)
    def engine_config(self, request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> EngineConfig:
        async_load: bool = request.param
        return conformance_engine_config(
            "SharedStorageConnector",
            extra_config={
                "shared_storage_path": str(tmp_path),
                "max_save_bytes_in_flight": "1MiB",
                "async_load": async_load,
                # The asynchronous run also takes the fsync'd write path.
                "fsync": async_load,
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
                            "max_save_bytes_in_flight": "1MiB",
                        },
                    },
                ]
            },
        )


class TestTieredOffloadConnector(ConnectorConformanceSuite):
    """A pool of a few blocks in front of a directory: blocks spill and come back through it."""

    @pytest.fixture(params=[*LOAD_MODES, pytest.param("write_through", id="write-through")])
    def engine_config(self, request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> EngineConfig:
        write_through = request.param == "write_through"
        return conformance_engine_config(
            "TieredOffloadConnector",
            extra_config={
                "cpu_pool_bytes": "64KiB",
                "async_load": request.param is True,
                "write_policy": "write_through" if write_through else "spill",
                "eviction": "arc",
                "tiers": [{"medium": "directory", "shared_storage_path": str(tmp_path)}],
            },
        )

    def test_hybrid_model_moves_only_blocks_inside_the_sliding_window(
        self,
        hybrid_config: EngineConfig,
        long_distinct_prompts: list[GenerationRequest],
        kvwire_instruments: Instruments,
    ) -> None:
        # The bytes saved with HMA on and off are compared: a pool of a few blocks
        # saves what fits, and with HMA off (blocks of every layer) less fits, so
        # the comparison gets a pool that holds the prompts either way. The
        # class's other hybrid checks keep the small pool, which spills.
        transfer = hybrid_config.kv_transfer_config
        assert transfer is not None
        roomy = attrs.evolve(
            hybrid_config,
            kv_transfer_config=attrs.evolve(
                transfer,
                kv_connector_extra_config={
                    **transfer.kv_connector_extra_config,
                    "cpu_pool_bytes": "256KiB",
                },
            ),
        )
        super().test_hybrid_model_moves_only_blocks_inside_the_sliding_window(
            roomy, long_distinct_prompts, kvwire_instruments
        )
