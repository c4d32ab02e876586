"""RedisConnector's configuration errors and cache reset, without an engine around it."""

from __future__ import annotations

import pytest

from kvwire.config.extra_config import ExtraConfigError
from kvwire.connectors.offload import RedisConnector
from kvwire.engine.engine import build_kv_cache_config
from kvwire.interface.base import KVConnectorRole
from kvwire.media.store.redis import RedisMedium
from tests.support.entries import block_hash
from tests.support.pairs import build_connector
from tests.support.redis import RedisServer, tiny_config, with_redis


def _connector(url: str, key_prefix: str = "kvwire:", **extra: object) -> RedisConnector:
    config = with_redis(tiny_config(), url, key_prefix, **extra)
    return build_connector(
        RedisConnector, config, KVConnectorRole.SCHEDULER, build_kv_cache_config(config)
    )


def _medium(connector: RedisConnector) -> RedisMedium:
    medium = connector.medium
    assert isinstance(medium, RedisMedium)
    return medium


def test_an_unknown_key_is_named_with_the_accepted_ones() -> None:
    with pytest.raises(ExtraConfigError) as raised:
        _connector("redis://127.0.0.1:6379/0", ttl=60)

    message = str(raised.value)
    assert "kv_connector_extra_config.ttl is not an option of RedisConnector" in message
    assert "ttl_seconds" in message and "password_env" in message and "io_threads" in message


def test_a_bad_redis_value_names_the_key_and_what_is_accepted() -> None:
    with pytest.raises(ExtraConfigError, match=r"RedisConnector: invalid Redis settings") as raised:
        _connector("redis://127.0.0.1:6379/0", pool_size=0)

    assert (
        "kv_connector_extra_config.pool_size: expected a whole number of connections > 0, got 0"
        in (str(raised.value))
    )


def test_a_bad_url_is_reported_without_its_password() -> None:
    with pytest.raises(ExtraConfigError) as raised:
        _connector("http://kv:hunter2-secret@cache:6379/0")

    assert (
        "scheme must be one of redis://, rediss://, unix://, redis+cluster://, "
        "rediss+cluster://, got 'http'"
    ) in str(raised.value)
    assert "hunter2-secret" not in str(raised.value)


def test_building_the_connector_does_not_need_the_server() -> None:
    # Nothing listens on port 1: the connector is built, and a lookup is a miss.
    connector = _connector("redis://127.0.0.1:1/0", connect_timeout_s=0.5)
    try:
        store = _medium(connector).store
        assert not store.counters()["lookup_failures"]
        assert store.count_prefix(["a"]) == 0
        assert not store.is_available
    finally:
        connector.shutdown()


def test_reset_cache_forgets_this_layouts_blocks_only(
    redis_server: RedisServer, key_prefix: str
) -> None:
    connector = _connector(redis_server.url, key_prefix)
    medium = _medium(connector)
    store = medium.store
    ours = medium.store_key(block_hash(0))
    foreign = "another-layout-fingerprint/" + block_hash(0).hex()
    entry = memoryview(bytearray(64))
    try:
        assert store.put([ours, foreign], [entry, entry]) == [True, True]

        assert connector.reset_cache() is True

        assert store.count_prefix([ours]) == 0
        assert store.count_prefix([foreign]) == 1
    finally:
        store.clear()
        connector.shutdown()


@pytest.mark.parametrize(("socket_timeout_s", "grace_s"), [(5.0, 10.0), (30.0, 60.0)])
def test_a_given_up_loads_read_under_way_gets_longer_than_the_socket_timeout(
    socket_timeout_s: float, grace_s: float
) -> None:
    # A Redis read in flight returns within the socket timeout: the grace before
    # LateWriteError stops the engine must outlast it, whatever the user set.
    connector = _connector(
        "redis://127.0.0.1:1/0", connect_timeout_s=0.5, socket_timeout_s=socket_timeout_s
    )
    try:
        assert _medium(connector).late_write_grace_s() == grace_s
    finally:
        connector.shutdown()
