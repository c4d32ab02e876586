"""RedisBlockStore when the server dies, comes back, runs out of memory or evicts keys."""

from __future__ import annotations

import logging
import threading

import pytest

from kvwire.blocks.format import verify_entry
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.entries import SMALL_LAYOUT, block_hash, encoded_entry, store_keys
from tests.support.redis import DribblingServer, RedisServer, wait_until_available
from tests.support.waits import finishes_within

LAYOUT = SMALL_LAYOUT


def _store(server: RedisServer, **overrides: object) -> RedisBlockStore:
    settings = RedisStoreSettings(url=server.url, key_prefix="faults:", **overrides)  # type: ignore[arg-type]
    return RedisBlockStore(settings)


def _entries(indices: range) -> list[memoryview]:
    return [memoryview(encoded_entry(LAYOUT, index)) for index in indices]


def _buffers(count: int) -> list[memoryview]:
    return [memoryview(bytearray(LAYOUT.entry_bytes)) for _ in range(count)]


def test_a_dead_server_gives_misses_dropped_saves_and_failed_loads_without_raising(
    fault_server: RedisServer,
) -> None:
    store = _store(fault_server, retry_interval_s=0.001)
    assert store.put(store_keys(LAYOUT, 2), _entries(range(2))) == [True, True]
    fault_server.kill()

    assert store.count_prefix(store_keys(LAYOUT, 2)) == 0
    assert store.put(store_keys(LAYOUT, 3), _entries(range(3))) == [False] * 3
    assert store.get_into(store_keys(LAYOUT, 2), _buffers(2)) == [None, None]
    assert not store.is_available
    counters = store.counters()
    assert counters["saves_dropped"] == 3
    assert counters["load_failures"] == 2
    store.close()


def test_the_store_reconnects_by_itself_when_the_server_comes_back(
    fault_server: RedisServer,
) -> None:
    store = _store(fault_server, retry_interval_s=0.001)
    assert store.put(store_keys(LAYOUT, 1), _entries(range(1))) == [True]
    fault_server.kill()
    assert store.count_prefix(store_keys(LAYOUT, 1)) == 0

    fault_server.restart()  # empty: a killed server keeps nothing
    wait_until_available(store)

    assert store.put(store_keys(LAYOUT, 2), _entries(range(2))) == [True, True]
    assert store.is_available
    buffers = _buffers(2)
    assert store.get_into(store_keys(LAYOUT, 2), buffers) == [LAYOUT.entry_bytes] * 2
    verify_entry(buffers[1], LAYOUT, block_hash(1))
    store.close()


def test_during_an_outage_calls_answer_at_once_until_the_probe_finds_the_server(
    fault_server: RedisServer,
) -> None:
    store = _store(fault_server, retry_interval_s=3600)
    fault_server.kill()
    assert store.count_prefix(store_keys(LAYOUT, 1)) == 0
    fault_server.restart()
    fault_server.client().set(store.redis_key(store_keys(LAYOUT, 1)[0]), b"present")

    # The server is back, but until the next probe the store keeps answering
    # from memory: a dead remote host must not cost every lookup a connect timeout.
    assert store.count_prefix(store_keys(LAYOUT, 1)) == 0
    assert store.put(store_keys(LAYOUT, 1), _entries(range(1))) == [False]
    store.close()


def test_outage_warnings_are_rate_limited(
    fault_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(fault_server, retry_interval_s=0.001, warning_interval_s=3600)
    fault_server.kill()

    with caplog.at_level(logging.WARNING, logger="kvwire.media.store.redis.server"):
        for _ in range(20):
            store.put(store_keys(LAYOUT, 1), _entries(range(1)))
            store.count_prefix(store_keys(LAYOUT, 1))

    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "is unavailable" in warnings[0].getMessage()
    store.close()


def test_the_server_coming_back_is_logged_once(
    fault_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(fault_server, retry_interval_s=0.001)
    fault_server.kill()
    store.count_prefix(store_keys(LAYOUT, 1))
    caplog.clear()

    with caplog.at_level(logging.WARNING, logger="kvwire.media.store.redis.server"):
        fault_server.restart()
        wait_until_available(store)
        store.count_prefix(store_keys(LAYOUT, 1))
        store.count_prefix(store_keys(LAYOUT, 1))

    assert [record.getMessage() for record in caplog.records] == [
        f"Redis at {fault_server.url} is reachable again; reconnected"
    ]
    store.close()


def test_a_full_server_without_eviction_rejects_saves_without_raising(
    fault_server: RedisServer,
) -> None:
    store = _store(fault_server)
    fault_server.cap_memory(64 * 1024, "noeviction")
    big = LAYOUT.entry_bytes
    count = (256 * 1024) // big

    stored = store.put(store_keys(LAYOUT, count), _entries(range(count)))

    assert stored[0] is True
    assert stored[-1] is False
    assert store.counters()["saves_rejected"] == stored.count(False)
    assert store.is_available  # a full server is not an outage
    # Every block the store said it saved loads back whole.
    saved = stored.index(False)
    buffers = _buffers(saved)
    assert store.get_into(store_keys(LAYOUT, saved), buffers) == [big] * saved
    for index, buffer in enumerate(buffers):
        verify_entry(buffer, LAYOUT, block_hash(index))
    store.close()


def test_under_an_lru_memory_limit_evicted_blocks_are_misses_and_survivors_load_whole(
    fault_server: RedisServer,
) -> None:
    store = _store(fault_server)
    fault_server.cap_memory(128 * 1024, "allkeys-lru")
    count = (512 * 1024) // LAYOUT.entry_bytes

    assert store.put(store_keys(LAYOUT, count), _entries(range(count))) == [True] * count
    assert int(fault_server.client().info("stats")["evicted_keys"]) > 0
    # At its limit the server evicts before any command, reads too (their
    # query and reply buffers count against it): a key the load found could
    # be gone by the lookup after it. Lifted, what the saves left holds still.
    fault_server.lift_memory_cap()

    buffers = _buffers(count)
    sizes = store.get_into(store_keys(LAYOUT, count), buffers)
    assert None in sizes  # the saves' evictions are misses
    assert store.count_prefix(store_keys(LAYOUT, count)) == sizes.index(None)
    for index, (size, buffer) in enumerate(zip(sizes, buffers, strict=True)):
        if size is not None:
            verify_entry(buffer, LAYOUT, block_hash(index))
    store.close()


def test_a_key_evicted_between_lookup_and_load_is_a_failed_load(
    fault_server: RedisServer,
) -> None:
    store = _store(fault_server)
    keys = store_keys(LAYOUT, 3)
    store.put(keys, _entries(range(3)))
    assert store.count_prefix(keys) == 3

    fault_server.client().delete(store.redis_key(keys[1]))
    buffers = _buffers(3)

    assert store.get_into(keys, buffers) == [LAYOUT.entry_bytes, None, LAYOUT.entry_bytes]
    assert buffers[1].tobytes() == bytes(LAYOUT.entry_bytes)
    store.close()


def test_a_load_waiting_on_the_server_when_it_dies_returns_failures(
    fault_server: RedisServer,
) -> None:
    store = _store(fault_server, retry_interval_s=0.001, socket_timeout_s=60)
    keys = store_keys(LAYOUT, 2)
    assert store.put(keys, _entries(range(2))) == [True, True]
    # The server holds every command from now on: the load below waits for
    # its replies until the server is killed under it.
    fault_server.client().execute_command("CLIENT", "PAUSE", 60_000, "ALL")
    results: list[list[int | None]] = []
    loader = threading.Thread(target=lambda: results.append(store.get_into(keys, _buffers(2))))
    loader.start()
    loader.join(timeout=0.5)
    assert loader.is_alive()  # stuck on the paused server, as a load in flight would be

    fault_server.kill()
    loader.join(timeout=30)

    assert results == [[None, None]]
    assert store.counters()["load_failures"] == 2
    store.close()


def test_a_server_dying_in_the_middle_of_a_read_fails_only_the_entries_not_yet_read(
    fault_server: RedisServer,
) -> None:
    # One entry per group of GETs. The next group is requested as soon as an
    # entry is read, so entry 1 may still arrive after the kill; entry 2 is
    # requested only once entry 1 is read, from a server that is gone.
    store = _store(fault_server, retry_interval_s=3600, pipeline_bytes=2 * LAYOUT.entry_bytes)
    keys = store_keys(LAYOUT, 3)
    assert store.put(keys, _entries(range(3))) == [True] * 3
    buffers = _buffers(3)
    landed = store.read_each(keys, buffers)
    assert next(landed) == (0, LAYOUT.entry_bytes)

    fault_server.kill()

    rest = list(landed)
    assert [index for index, _ in rest] == [1, 2]
    assert rest[-1] == (2, None)
    verify_entry(buffers[0], LAYOUT, block_hash(0))
    if rest[0][1] is not None:
        verify_entry(buffers[1][: rest[0][1]], LAYOUT, block_hash(1))
    assert store.counters()["load_failures"] == sum(size is None for _, size in rest)
    assert not store.is_available
    store.close()


@pytest.mark.slow
def test_after_a_server_hangs_calls_stop_waiting_on_it(fault_server: RedisServer) -> None:
    admin = fault_server.client()
    store = _store(fault_server, retry_interval_s=3600, socket_timeout_s=0.3)
    connections_before = int(admin.info("stats")["total_connections_received"])
    # A hung server: it accepts connections but answers nothing for 3 s.
    admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")

    assert store.count_prefix(store_keys(LAYOUT, 1)) == 0  # waits out its socket timeout
    assert not store.is_available
    for _ in range(20):  # these answer from memory, without a connection attempt
        assert store.count_prefix(store_keys(LAYOUT, 1)) == 0
        assert store.put(store_keys(LAYOUT, 1), _entries(range(1))) == [False]
        assert store.get_into(store_keys(LAYOUT, 1), _buffers(1)) == [None]

    admin.ping()  # held until the pause ends
    opened = int(admin.info("stats")["total_connections_received"]) - connections_before
    assert opened <= 2  # the first call's connection and its one retry, nothing after
    store.close()


@pytest.mark.slow
def test_lookups_on_a_hung_server_wait_one_lookup_timeout_then_miss_until_it_answers_again(
    fault_server: RedisServer,
) -> None:
    # Socket and connect timeouts of 10 s: the first lookup opens the store's
    # first connection, which a stopped server accepts and never answers.
    store = _store(fault_server, socket_timeout_s=10, connect_timeout_s=10, retry_interval_s=0.05)
    keys = store_keys(LAYOUT, 1)
    fault_server.client().set(store.redis_key(keys[0]), b"present")

    with fault_server.paused():
        # Eight lookups: far within a socket timeout each (80 s), one lookup_timeout_s (1 s).
        counts = finishes_within(5.0, lambda: [store.count_prefix(keys) for _ in range(8)])
        assert not store.is_available
    assert counts == [0] * 8
    assert store.counters()["lookup_failures"] == 1  # one asked; seven answered at once

    wait_until_available(store)
    assert store.count_prefix(keys) == 1
    store.close()


class _LongErrorServer(DribblingServer):
    """Answers every SET with an error reply of 200 KiB."""

    def _answer(self, command: list[bytes]) -> bytes:
        if command[0].upper() == b"SET":
            return b"-ERR " + b"x" * 200 * 1024 + b"\r\n"
        return super()._answer(command)


def test_a_long_error_reply_is_logged_bounded(caplog: pytest.LogCaptureFixture) -> None:
    server = _LongErrorServer()
    store = RedisBlockStore(RedisStoreSettings(url=server.url))
    try:
        with caplog.at_level(logging.WARNING, logger="kvwire.media.store.redis._outage"):
            assert store.put(store_keys(LAYOUT, 1), _entries(range(1))) == [False]
    finally:
        store.close()
        server.close()
    (line,) = [record.message for record in caplog.records if "rejected a save" in record.message]
    assert "ResponseError: ERR xxx" in line
    assert len(line) < 400
