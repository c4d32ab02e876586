"""RedisConnector through the conformance kit, synchronous and asynchronous loads.

Each test of the suite gets a key prefix of its own on the shared real server.
"""

from __future__ import annotations

import pathlib

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config
from tests.redis.conftest import RedisServer


class TestRedisConnector(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(
        self, tmp_path: pathlib.Path, redis_server: RedisServer, key_prefix: str
    ) -> EngineConfig:
        return conformance_engine_config(
            "RedisConnector",
            extra_config={
                "url": redis_server.url,
                "key_prefix": key_prefix,
                "staging_buffer_bytes": "1MiB",
            },
        )


class TestRedisConnectorAsyncLoads(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(
        self, tmp_path: pathlib.Path, redis_server: RedisServer, key_prefix: str
    ) -> EngineConfig:
        return conformance_engine_config(
            "RedisConnector",
            extra_config={
                "url": f"unix://{redis_server.unix_socket}",
                "key_prefix": key_prefix,
                "staging_buffer_bytes": "1MiB",
                "async_load": True,
            },
        )
