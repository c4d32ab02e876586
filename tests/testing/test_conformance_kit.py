"""The conformance kit, run on the engine tests' file-backed connector in each of its modes.

This is also how a connector author uses the kit: subclass the suite and
override ``engine_config``.
"""

from __future__ import annotations

import pathlib

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config
from tests.support.directory_connectors import DirectoryConnector


class TestDirectoryConnectorSync(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            DirectoryConnector, extra_config={"store_dir": str(tmp_path / "store")}
        )


class TestDirectoryConnectorAsyncWithDelayedFree(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path: pathlib.Path) -> EngineConfig:
        return conformance_engine_config(
            DirectoryConnector,
            extra_config={
                "store_dir": str(tmp_path / "store"),
                "load_async": True,
                "keep_blocks_until_sent": True,
                "answer_none_first": True,
            },
        )
