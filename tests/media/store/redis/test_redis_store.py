"""RedisBlockStore against a real redis-server: storing, loading, lookups and bad entries."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import attrs
import pytest

from kvwire.blocks.format import HEADER_SIZE, CorruptBlockError, verify_entry
from kvwire.media.store.redis._wire import RespStream, ZeroCopyCommandPacker
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.entries import SMALL_LAYOUT, block_hash, encoded_entry, store_keys
from tests.support.redis import TLS_DIR, RedisServer

LAYOUT = SMALL_LAYOUT
MakeStore = Callable[..., RedisBlockStore]


def _buffers(count: int, size: int = LAYOUT.entry_bytes) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(count)]


def _save(store: RedisBlockStore, indices: list[int]) -> list[bytearray]:
    entries = [encoded_entry(LAYOUT, index) for index in indices]
    keys = [LAYOUT.key(block_hash(index)) for index in indices]
    assert store.put(keys, [memoryview(entry) for entry in entries]) == [True] * len(indices)
    return entries


def _assert_loads_back(store: RedisBlockStore, entries: list[bytearray]) -> None:
    """``store`` loads ``entries``, saved as blocks 0, 1, ..., back bit-exact."""
    buffers = _buffers(len(entries))
    sizes = store.get_into(store_keys(LAYOUT, len(entries)), buffers)
    assert sizes == [LAYOUT.entry_bytes] * len(entries)
    assert [buffer.tobytes() for buffer in buffers] == [bytes(entry) for entry in entries]


@contextlib.contextmanager
def _store_as_acl_user(
    redis_server: RedisServer, key_prefix: str, user_name: str, password: str, key_patterns: str
) -> Iterator[RedisBlockStore]:
    """A store logged in as a new ACL user allowed ``key_patterns``; the user is deleted after."""
    admin = redis_server.client()
    user = f"{user_name}-{key_prefix.split(':')[1]}"
    admin.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=[key_patterns], commands=["+@all"]
    )
    store = RedisBlockStore(
        RedisStoreSettings(
            url=redis_server.url, username=user, password=password, key_prefix=key_prefix
        )
    )
    try:
        yield store
    finally:
        store.close()
        admin.acl_deluser(user)


def test_saved_entries_load_back_bit_exact_into_the_callers_buffers(
    redis_store: RedisBlockStore,
) -> None:
    entries = _save(redis_store, [0, 1, 2])
    buffers = _buffers(3)

    sizes = redis_store.get_into(store_keys(LAYOUT, 3), buffers)

    assert sizes == [LAYOUT.entry_bytes] * 3
    for index, (entry, buffer) in enumerate(zip(entries, buffers, strict=True)):
        assert buffer.tobytes() == bytes(entry)
        verify_entry(buffer, LAYOUT, block_hash(index))


def test_saves_and_loads_larger_than_one_pipeline_batch_round_trip(
    make_redis_store: MakeStore,
) -> None:
    store = make_redis_store(pipeline_bytes=2 * LAYOUT.entry_bytes)

    _assert_loads_back(store, _save(store, list(range(7))))


def test_read_each_hands_over_each_entry_before_the_next_is_read(
    redis_store: RedisBlockStore,
) -> None:
    entries = _save(redis_store, [0, 1, 2])
    buffers = _buffers(3)
    landed = redis_store.read_each(store_keys(LAYOUT, 3), buffers)

    assert next(landed) == (0, LAYOUT.entry_bytes)
    assert buffers[0].tobytes() == bytes(entries[0])
    # The next reply is still on its way: the caller may check entry 0 meanwhile.
    assert buffers[1].tobytes() == bytes(LAYOUT.entry_bytes)
    assert list(landed) == [(1, LAYOUT.entry_bytes), (2, LAYOUT.entry_bytes)]
    assert [buffer.tobytes() for buffer in buffers] == [bytes(entry) for entry in entries]


def test_a_load_asks_for_the_next_group_while_the_caller_checks_this_one(
    make_redis_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Groups of one GET (half of pipeline_bytes), so each send is one group.
    store = make_redis_store(pipeline_bytes=2 * LAYOUT.entry_bytes)
    entries = _save(store, list(range(5)))
    events: list[str] = []
    send = RespStream.send

    def recorded_send(stream: RespStream, pieces: Sequence[bytes | memoryview]) -> None:
        events.append("send")
        send(stream, pieces)

    monkeypatch.setattr(RespStream, "send", recorded_send)
    buffers = _buffers(5)

    for index, size in store.read_each(store_keys(LAYOUT, 5), buffers):
        assert size == LAYOUT.entry_bytes
        events.append(f"entry {index}")

    # Group k + 1 is asked for before entry k is handed over: the server runs
    # it meanwhile. Never more than two groups are unanswered.
    assert events == [
        "send", "send", "entry 0", "send", "entry 1", "send", "entry 2", "send", "entry 3",
        "entry 4",
    ]  # fmt: skip
    assert [buffer.tobytes() for buffer in buffers] == [bytes(entry) for entry in entries]


@pytest.mark.parametrize(
    "pipeline_bytes",
    [
        pytest.param(64 * 1024**2, id="one-group"),
        # Groups of one GET: two groups are unanswered when the caller stops.
        pytest.param(2 * LAYOUT.entry_bytes, id="groups-in-flight"),
    ],
)
def test_a_read_abandoned_mid_pipeline_leaves_the_connection_usable(
    make_redis_store: MakeStore, pipeline_bytes: int
) -> None:
    # One connection, so the next load must reuse whatever the first left behind.
    store = make_redis_store(pool_size=1, pipeline_bytes=pipeline_bytes)
    entries = _save(store, [0, 1, 2])
    landed = store.read_each(store_keys(LAYOUT, 3), _buffers(3))
    assert next(landed) == (0, LAYOUT.entry_bytes)

    landed.close()  # two replies unread

    _assert_loads_back(store, entries)
    assert store.is_available


def test_discard_deletes_the_entries_and_reports_only_those_that_existed(
    redis_store: RedisBlockStore,
) -> None:
    _save(redis_store, [0, 1])
    keys = store_keys(LAYOUT, 3)  # the third was never stored

    redis_store.discard(keys)

    assert redis_store.get_into(keys, _buffers(3)) == [None, None, None]
    assert redis_store.take_removed_keys() == keys[:2]
    assert redis_store.take_removed_keys() == []


def test_a_missing_key_loads_as_none_and_leaves_its_buffer_untouched(
    redis_store: RedisBlockStore,
) -> None:
    _save(redis_store, [0])
    buffers = _buffers(2)

    sizes = redis_store.get_into(store_keys(LAYOUT, 2), buffers)

    assert sizes == [LAYOUT.entry_bytes, None]
    assert buffers[1].tobytes() == bytes(LAYOUT.entry_bytes)


def test_an_entry_longer_than_its_buffer_is_a_failure_not_a_partial_read(
    redis_store: RedisBlockStore,
) -> None:
    _save(redis_store, [0])
    small = _buffers(1, size=LAYOUT.entry_bytes - 1)

    assert redis_store.get_into(store_keys(LAYOUT, 1), small) == [None]
    assert small[0].tobytes() == bytes(LAYOUT.entry_bytes - 1)
    assert redis_store.counters()["loads_oversized"] == 1


def test_a_value_longer_than_its_entry_is_warned_about_and_deleted(
    redis_server: RedisServer,
    redis_store: RedisBlockStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    keys = store_keys(LAYOUT, 2)
    _save(redis_store, [1])
    trailing = bytes(encoded_entry(LAYOUT, 0)) + b"trailing bytes"
    redis_server.client().set(redis_store.redis_key(keys[0]), trailing)
    buffers = _buffers(2)

    with caplog.at_level(logging.WARNING, logger="kvwire.media.store.redis.server"):
        sizes = redis_store.get_into(keys, buffers)

    assert sizes == [None, LAYOUT.entry_bytes]
    assert buffers[0].tobytes() == bytes(LAYOUT.entry_bytes)  # not a byte of it was read
    assert "1 value(s) longer than the entry they should hold" in caplog.text
    assert redis_server.client().exists(redis_store.redis_key(keys[0])) == 0
    assert redis_store.take_removed_keys() == [keys[0]]
    assert redis_store.counters()["loads_oversized"] == 1


def test_a_short_value_in_the_server_is_caught_by_verify_entry(
    redis_server: RedisServer, redis_store: RedisBlockStore
) -> None:
    key = LAYOUT.key(block_hash(0))
    truncated = bytes(encoded_entry(LAYOUT, 0))[: HEADER_SIZE + 10]
    redis_server.client().set(redis_store.redis_key(key), truncated)
    buffer = _buffers(1)[0]

    size = redis_store.get_into([key], [buffer])[0]

    assert size == len(truncated)
    with pytest.raises(CorruptBlockError, match="payload is 10 bytes"):
        verify_entry(buffer[:size], LAYOUT, block_hash(0))


def test_a_byte_flipped_in_the_server_is_caught_by_the_checksum(
    redis_server: RedisServer, redis_store: RedisBlockStore
) -> None:
    _save(redis_store, [0])
    key = redis_store.redis_key(LAYOUT.key(block_hash(0)))
    client = redis_server.client()
    flipped = bytes([client.getrange(key, HEADER_SIZE + 5, HEADER_SIZE + 5)[0] ^ 0xFF])
    client.setrange(key, HEADER_SIZE + 5, flipped)
    buffer = _buffers(1)[0]

    assert redis_store.get_into([LAYOUT.key(block_hash(0))], [buffer]) == [LAYOUT.entry_bytes]
    with pytest.raises(CorruptBlockError, match="checksum"):
        verify_entry(buffer, LAYOUT, block_hash(0))


def test_an_entry_without_a_payload_checksum_is_refused_as_corrupt(
    redis_server: RedisServer, redis_store: RedisBlockStore
) -> None:
    # What the CPU pool writes into its own memory; never loaded from a server.
    key = LAYOUT.key(block_hash(0))
    unchecked = encoded_entry(attrs.evolve(LAYOUT, payload_checksum=False), 0)
    redis_server.client().set(redis_store.redis_key(key), bytes(unchecked))
    buffer = _buffers(1)[0]

    assert redis_store.get_into([key], [buffer]) == [LAYOUT.entry_bytes]
    with pytest.raises(CorruptBlockError, match="carries no payload checksum"):
        verify_entry(buffer, LAYOUT, block_hash(0))


def test_a_foreign_value_under_a_block_key_is_caught_by_the_header_check(
    redis_server: RedisServer, redis_store: RedisBlockStore
) -> None:
    key = LAYOUT.key(block_hash(0))
    redis_server.client().set(redis_store.redis_key(key), b"not a kvwire block" * 10)
    buffer = _buffers(1)[0]

    size = redis_store.get_into([key], [buffer])[0]

    assert size is not None
    with pytest.raises(CorruptBlockError, match="bad magic"):
        verify_entry(buffer[:size], LAYOUT, block_hash(0))


def test_count_prefix_stops_at_the_first_missing_block(redis_store: RedisBlockStore) -> None:
    _save(redis_store, [0, 1, 3])

    assert redis_store.count_prefix(store_keys(LAYOUT, 4)) == 2


def test_count_prefix_spans_several_lookup_batches(make_redis_store: MakeStore) -> None:
    store = make_redis_store(lookup_batch_size=2)
    _save(store, [0, 1, 2, 3, 4, 6])

    assert store.count_prefix(store_keys(LAYOUT, 7)) == 5
    assert store.count_prefix(store_keys(LAYOUT, 4)) == 4


def test_keys_in_the_server_are_the_prefix_then_fingerprint_then_block_hash(
    redis_server: RedisServer, redis_store: RedisBlockStore, key_prefix: str
) -> None:
    _save(redis_store, [0])

    expected = f"{key_prefix}{LAYOUT.fingerprint_hex}/{block_hash(0).hex()}"
    assert redis_server.client().exists(expected) == 1


def test_entries_expire_after_the_configured_ttl(
    redis_server: RedisServer, make_redis_store: MakeStore
) -> None:
    store = make_redis_store(ttl_seconds=120)
    _save(store, [0])

    remaining_ms = redis_server.client().pttl(store.redis_key(LAYOUT.key(block_hash(0))))
    assert 0 < remaining_ms <= 120_000


def test_a_load_restarts_the_ttl_of_the_blocks_it_reads(
    redis_server: RedisServer, make_redis_store: MakeStore
) -> None:
    store = make_redis_store(ttl_seconds=600)
    _save(store, [0])
    name = store.redis_key(LAYOUT.key(block_hash(0)))
    client = redis_server.client()
    client.expire(name, 30)  # as if it had been idle for most of its TTL

    assert store.get_into(store_keys(LAYOUT, 1), _buffers(1)) == [LAYOUT.entry_bytes]

    assert client.ttl(name) > 30


def test_entries_never_expire_without_a_ttl(
    redis_server: RedisServer, redis_store: RedisBlockStore
) -> None:
    _save(redis_store, [0])

    assert redis_server.client().ttl(redis_store.redis_key(LAYOUT.key(block_hash(0)))) == -1


def test_a_unix_socket_url_reaches_the_same_server(
    redis_server: RedisServer, redis_store: RedisBlockStore, make_redis_store: MakeStore
) -> None:
    entries = _save(redis_store, [0])
    over_socket = make_redis_store(url=f"unix://{redis_server.unix_socket}")

    _assert_loads_back(over_socket, entries)


def test_an_acl_user_with_a_password_can_store_and_load(
    redis_server: RedisServer, redis_store: RedisBlockStore, key_prefix: str
) -> None:
    # redis_store shares the prefix: it clears the user's entries afterwards.
    with _store_as_acl_user(redis_server, key_prefix, "kvwire", "acl-secret-1", "*") as store:
        _assert_loads_back(store, _save(store, [0]))


def test_clear_removes_only_this_prefixs_keys(
    redis_server: RedisServer, redis_store: RedisBlockStore
) -> None:
    _save(redis_store, [0, 1])
    redis_server.client().set("someone-else:key", b"kept")

    assert redis_store.clear() == 2
    assert redis_store.count_prefix(store_keys(LAYOUT, 1)) == 0
    assert redis_server.client().get("someone-else:key") == b"kept"
    redis_server.client().delete("someone-else:key")


def test_large_values_are_handed_to_the_socket_without_a_copy() -> None:
    staging = bytearray(1024 * 1024)
    view = memoryview(staging)

    pieces = ZeroCopyCommandPacker().pack("SET", "key", view, "EX", 60)

    assert any(isinstance(piece, memoryview) and piece.obj is staging for piece in pieces)
    wire = b"".join(bytes(piece) for piece in pieces)
    assert wire.startswith(b"*5\r\n$3\r\nSET\r\n$3\r\nkey\r\n$1048576\r\n")
    assert wire.endswith(b"\r\n$2\r\nEX\r\n$2\r\n60\r\n")


def test_one_pipeline_of_misses_oversized_and_large_values_stays_in_step(
    redis_server: RedisServer, redis_store: RedisBlockStore
) -> None:
    client = redis_server.client()
    large = bytes(range(256)) * (3 * 4096 + 7)  # larger than the reader's scratch buffer
    client.set(redis_store.redis_key("large-1"), large)
    client.set(redis_store.redis_key("too-big"), b"x" * 100)
    client.set(redis_store.redis_key("large-2"), large[::-1])
    client.set(redis_store.redis_key("empty"), b"")
    names = ["too-big", "large-1", "missing", "large-2", "empty"]
    buffers = [memoryview(bytearray(50)), *_buffers(4, len(large))]

    sizes = redis_store.get_into(names, buffers)

    assert sizes == [None, len(large), None, len(large), 0]
    assert buffers[1].tobytes() == large
    assert buffers[3].tobytes() == large[::-1]
    # The connection is still in step: the next load reads the right value.
    again = _buffers(1, len(large))
    assert redis_store.get_into(["large-1"], again) == [len(large)]
    assert again[0].tobytes() == large


def test_a_key_of_another_type_is_a_failed_load_not_an_error(
    redis_server: RedisServer, redis_store: RedisBlockStore
) -> None:
    redis_server.client().rpush(redis_store.redis_key("a-list"), b"item")

    assert redis_store.get_into(["a-list"], _buffers(1)) == [None]
    assert redis_store.counters()["loads_refused"] == 1
    assert redis_store.is_available


def test_a_rediss_url_stores_and_loads_over_tls(tls_url: str, make_redis_store: MakeStore) -> None:
    store = make_redis_store(url=tls_url, tls_ca_certs=str(TLS_DIR / "ca.crt"))

    _assert_loads_back(store, _save(store, [0, 1]))


def test_a_tls_server_whose_certificate_cannot_be_verified_is_unreachable(
    tls_url: str, key_prefix: str
) -> None:
    # Without the test CA the server's certificate is not trusted: an outage, not a connection.
    store = RedisBlockStore(RedisStoreSettings(url=tls_url, key_prefix=key_prefix))

    assert store.count_prefix(store_keys(LAYOUT, 1)) == 0
    assert not store.is_available
    store.close()


def test_an_acl_user_denied_the_keys_gets_failures_not_exceptions(
    redis_server: RedisServer, key_prefix: str
) -> None:
    with _store_as_acl_user(
        redis_server, key_prefix, "kvwire-denied", "acl-secret-2", "elsewhere:*"
    ) as store:
        entries = [memoryview(encoded_entry(LAYOUT, 0))]
        assert store.put(store_keys(LAYOUT, 1), entries) == [False]
        assert store.count_prefix(store_keys(LAYOUT, 1)) == 0
        assert store.get_into(store_keys(LAYOUT, 1), _buffers(1)) == [None]
        counters = store.counters()
        assert counters["saves_rejected"] == 1
        assert counters["loads_refused"] == 1


def test_threads_sharing_one_store_only_ever_load_whole_entries(
    make_redis_store: MakeStore,
) -> None:
    # Fewer connections than threads: they take turns on the pooled connections.
    store = make_redis_store(pool_size=2)
    keys = store_keys(LAYOUT, 8)
    entries = [memoryview(encoded_entry(LAYOUT, index)) for index in range(8)]
    problems: list[str] = []

    def write() -> None:
        for _ in range(30):
            if not all(store.put(keys, entries)):
                problems.append("a save failed")

    def read() -> None:
        buffers = _buffers(8)
        for _ in range(30):
            for index, size in enumerate(store.get_into(keys, buffers)):
                if size is None:
                    continue  # not written yet
                try:
                    verify_entry(buffers[index][:size], LAYOUT, block_hash(index))
                except CorruptBlockError as error:
                    problems.append(f"block {index}: {error.reason}")

    threads = [threading.Thread(target=work) for work in (write, write, read, read, read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert problems == []
    assert store.count_prefix(keys) == 8
