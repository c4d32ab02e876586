"""RedisConnector through the conformance kit: over TCP with synchronous loads, and over
a unix socket with asynchronous ones.

Each test of the suite gets a key prefix of its own on the shared real server.
"""

from __future__ import annotations

import pathlib

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config
from tests.support.redis import UNHURRIED_REDIS, RedisServer


class TestRedisConnector(ConnectorConformanceSuite):
    @pytest.fixture(
        params=[
            pytest.param(False, id="tcp-sync-loads"),
            pytest.param(True, id="unix-socket-async-loads"),
        ]
    )
    def engine_config(
        self,
        request: pytest.FixtureRequest,
        tmp_path: pathlib.Path,
        redis_server: RedisServer,
        key_prefix: str,
    ) -> EngineConfig:
        over_unix_socket_async: bool = request.param
        url = f"unix://{redis_server.unix_socket}" if over_unix_socket_async else redis_server.url
        return conformance_engine_config(
            "RedisConnector",
            extra_config={
                "url": url,
                "key_prefix": key_prefix,
                **UNHURRIED_REDIS,
                "max_save_bytes_in_flight": "1MiB",
                "async_load": over_unix_socket_async,
            },
        )
