"""RedisConnector on a Redis Cluster through the conformance kit (synchronous and async loads).

Each test of the suite gets a key prefix of its own on the shared local cluster.
"""

from __future__ import annotations

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config
from tests.support.redis import UNHURRIED_REDIS, LocalCluster

# Each needs the six-process local cluster (about 2 s to start): kept out of the fast loop.
pytestmark = pytest.mark.slow


class TestRedisClusterConnector(ConnectorConformanceSuite):
    @pytest.fixture(
        params=[pytest.param(False, id="sync-loads"), pytest.param(True, id="async-loads")]
    )
    def engine_config(
        self, request: pytest.FixtureRequest, redis_cluster: LocalCluster, key_prefix: str
    ) -> EngineConfig:
        return conformance_engine_config(
            "RedisConnector",
            extra_config={
                "url": redis_cluster.url,
                "key_prefix": key_prefix,
                **UNHURRIED_REDIS,
                "max_save_bytes_in_flight": "1MiB",
                "async_load": request.param,
            },
        )
