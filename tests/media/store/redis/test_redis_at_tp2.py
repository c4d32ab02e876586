"""RedisConnector through the kit's parallel section: two tensor-parallel ranks, real servers.

On one redis-server and on a local Redis Cluster (six processes): entries of
one KV head each, so TP=1 and TP=2 engines read each other's.
"""

from __future__ import annotations

import pathlib

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ParallelConformanceSuite, conformance_engine_config
from tests.support.redis import UNHURRIED_REDIS, LocalCluster, RedisServer

pytestmark = pytest.mark.slow


class TestRedisConnectorAtTP2(ParallelConformanceSuite):
    @pytest.fixture
    def engine_config(
        self, tmp_path: pathlib.Path, redis_server: RedisServer, key_prefix: str
    ) -> EngineConfig:
        return conformance_engine_config(
            "RedisConnector",
            extra_config={
                "url": redis_server.url,
                "key_prefix": key_prefix,
                **UNHURRIED_REDIS,
                "max_save_bytes_in_flight": "1MiB",
                # One KV head an entry: TP=1 and TP=2 engines read each other's.
                "entry_kv_heads": 1,
            },
        )


class TestRedisClusterConnectorAtTP2(ParallelConformanceSuite):
    @pytest.fixture
    def engine_config(self, redis_cluster: LocalCluster, key_prefix: str) -> EngineConfig:
        return conformance_engine_config(
            "RedisConnector",
            extra_config={
                "url": redis_cluster.url,
                "key_prefix": key_prefix,
                **UNHURRIED_REDIS,
                "max_save_bytes_in_flight": "1MiB",
                "entry_kv_heads": 1,
            },
        )
