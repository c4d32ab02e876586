"""Redis on a hybrid cache: the store connectors' per-group rules, on a real server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvwire.connectors.offload import RedisConnector
from tests.support.pairs import hybrid_engine_config
from tests.support.redis import RedisServer
from tests.support.stores import HybridFactory, HybridStorePair, StoreGroupsContract


@pytest.fixture
def hybrid(
    redis_server: RedisServer, key_prefix: str, pairs: list[HybridStorePair]
) -> Iterator[HybridFactory]:
    def build(**extra: object) -> HybridStorePair:
        options = {
            "url": redis_server.url,
            "key_prefix": key_prefix,
            "max_save_bytes_in_flight": "1MiB",
        }
        config = hybrid_engine_config("RedisConnector", {**options, **extra})
        pair = HybridStorePair(RedisConnector, config)
        pairs.append(pair)
        return pair

    yield build
    for pair in pairs:
        pair.medium.store.clear()


class TestRedisGroups(StoreGroupsContract):
    pass
