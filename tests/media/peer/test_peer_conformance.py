"""The peer medium through the conformance kit: a real directory server, NIXL over loopback.

The kit's warm passes are served from the engine's own pool, found through
the directory like any peer's (the two-process cases are in
test_peer_engines.py); with the worker in its own process, the scheduler and
the worker agree on the peer's name through the engine id.
"""

from __future__ import annotations

import pytest

from kvwire.config import EngineConfig
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config
from tests.support.redis import RedisServer

pytestmark = pytest.mark.slow


class TestPeerMedium(ConnectorConformanceSuite):
    # Asynchronous loads, as the decode profile has them; the engine tests load synchronously.
    @pytest.fixture
    def engine_config(self, redis_server: RedisServer, key_prefix: str) -> EngineConfig:
        return conformance_engine_config(
            "OffloadConnector",
            extra_config={
                "medium": "peer",
                "url": redis_server.url,
                "key_prefix": key_prefix,
                "cpu_pool_bytes": "8MiB",
                "async_load": True,
            },
        )
