"""The peer medium's directory on a real local Redis Cluster: entries and peer records on the
master of each key's slot, withdrawals that keep a newer entry, expiries, and an unreachable
cluster counted as directory failures whose calls are misses."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvwire.media.peer._directory import Location, PeerDirectory, PeerRecord
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.redis import LocalCluster

TTL_S = 30.0


def directory_at(url: str, key_prefix: str, **extra: object) -> PeerDirectory:
    settings = RedisStoreSettings.from_extra_config({"url": url, "key_prefix": key_prefix, **extra})
    return PeerDirectory(settings, TTL_S)


@pytest.fixture
def directory(redis_cluster: LocalCluster, key_prefix: str) -> Iterator[PeerDirectory]:
    made = directory_at(redis_cluster.url, key_prefix)
    yield made
    made.close()


def keys_on_every_master(
    cluster: LocalCluster, directory: PeerDirectory, count: int = 24
) -> list[str]:
    keys = [directory.entry_key("f" * 16, bytes([n]) * 16) for n in range(count)]
    owners = {cluster.node_of_key(key).port for key in keys}
    # Without keys on several masters the test would not show one call reaching each.
    assert len(owners) == len(cluster.masters())
    return keys


def test_announced_entries_across_slots_are_found_in_one_call_each_on_its_master(
    redis_cluster: LocalCluster, directory: PeerDirectory
) -> None:
    keys = keys_on_every_master(redis_cluster, directory)
    announced = {key: Location("a", n, 7) for n, key in enumerate(keys[:-1])}
    directory.announce(list(announced.items()))

    assert directory.look_up(keys) == [*announced.values(), None]
    for key, location in announced.items():
        stored = redis_cluster.node_of_key(key).client().get(key)
        assert stored == location.encode()
        assert 0 < int(redis_cluster.node_of_key(key).client().pttl(key)) <= TTL_S * 1000
    assert directory.take_failures() == 0


def test_a_withdrawal_deletes_only_the_entries_it_names_keeping_newer_ones(
    redis_cluster: LocalCluster, directory: PeerDirectory
) -> None:
    keys = keys_on_every_master(redis_cluster, directory, count=12)
    old = {key: Location("a", n, 1) for n, key in enumerate(keys)}
    directory.announce(list(old.items()))
    # Half the blocks were saved again since (a newer generation, another peer).
    newer = {key: Location("b", n, 2) for n, key in enumerate(keys) if n % 2}
    directory.announce(list(newer.items()))

    assert directory.withdraw(list(old.items())) == len(keys) - len(newer)
    assert directory.look_up(keys) == [newer.get(key) for key in keys]
    assert directory.withdraw(list(newer.items())) == len(newer)
    assert directory.look_up(keys) == [None] * len(keys)
    assert directory.take_failures() == 0


def test_peer_records_round_trip_and_are_withdrawn(
    redis_cluster: LocalCluster, directory: PeerDirectory
) -> None:
    records = {
        name: PeerRecord(bytes([n]) * 300, 4096 * (n + 1), 64, 8)
        for n, name in enumerate(("a", "b", "c", "d"))
    }
    for name, record in records.items():
        assert directory.publish_peer(name, record)
    assert {name: directory.fetch_peer(name) for name in records} == records
    assert len({redis_cluster.node_of_key(directory.peer_key(name)).port for name in records}) > 1

    directory.withdraw_peer("a")
    assert directory.fetch_peer("a") is None
    assert directory.fetch_peer("b") == records["b"]
    assert directory.take_failures() == 0


def test_entries_and_peer_records_last_until_their_expiry(
    redis_cluster: LocalCluster, key_prefix: str
) -> None:
    settings = RedisStoreSettings.from_extra_config(
        {"url": redis_cluster.url, "key_prefix": key_prefix}
    )
    directory = PeerDirectory(settings, 0.3)
    try:
        keys = keys_on_every_master(redis_cluster, directory, count=12)
        directory.announce([(key, Location("a", n, 1)) for n, key in enumerate(keys)])
        assert directory.publish_peer("a", PeerRecord(b"m", 0, 1, 1))
        assert None not in directory.look_up(keys)
        time.sleep(0.6)
        assert directory.look_up(keys) == [None] * len(keys)
        assert directory.fetch_peer("a") is None
        assert directory.take_failures() == 0
    finally:
        directory.close()


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_cluster_is_counted_as_failures_and_every_call_is_a_miss(
    key_prefix: str,
) -> None:
    directory = directory_at(
        f"redis+cluster://127.0.0.1:{unused_port()}", key_prefix, socket_timeout_s=0.5
    )
    try:
        location = Location("a", 0, 1)
        key = directory.entry_key("f" * 16, b"\x01" * 16)
        assert directory.look_up([key, key]) == [None, None]
        assert not directory.announce([(key, location)])
        assert directory.withdraw([(key, location)]) is None  # not made: owed, not done
        assert not directory.publish_peer("a", PeerRecord(b"m", 0, 1, 1))
        assert directory.fetch_peer("a") is None
        directory.withdraw_peer("a")
        assert directory.take_failures() == 6
        assert directory.take_failures() == 0
    finally:
        directory.close()
