"""The peer medium through the kit's parallel section: two tensor-parallel ranks, real NIXL.

Each rank's worker exposes its pool (its KV heads) through its own NIXL
agent and peer record; the warm pass pulls each rank's share from the same
rank. A peer's entries live while it runs, and engines split differently
never read each other's (the directory names the split): the kit's
cross-size passes load nothing, with equal tokens.
"""

from __future__ import annotations

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ParallelConformanceSuite, conformance_engine_config
from tests.support.redis import RedisServer

pytestmark = pytest.mark.slow


class TestPeerMediumAtTP2(ParallelConformanceSuite):
    loads_across_engines = False

    @pytest.fixture
    def engine_config(self, redis_server: RedisServer, key_prefix: str) -> EngineConfig:
        return conformance_engine_config(
            "OffloadConnector",
            extra_config={
                "medium": "peer",
                "url": redis_server.url,
                "key_prefix": key_prefix,
                "cpu_pool_bytes": "8MiB",
            },
        )
