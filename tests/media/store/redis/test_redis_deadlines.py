"""Every call to the Redis server ends by its deadline, however slowly the server answers.

The server here sends the replies to chosen commands a byte every 0.2 s:
each read is well within the socket timeout (5 s), but a whole entry would
take minutes. Without an overall deadline per call, these tests hang until
pytest-timeout stops them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvwire.blocks.format import verify_entry
from kvwire.media.store.redis.server import RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.entries import SMALL_LAYOUT, block_hash, encoded_entry, store_keys
from tests.support.redis import (
    DribblingServer,
    generate,
    generate_with_stats,
    shared_prefix_workload,
    tiny_config,
    wait_until_available,
    with_redis,
)
from tests.support.redis import tokens as tokens_of

LAYOUT = SMALL_LAYOUT
DEADLINE_S = 0.5
# Time a call may take beyond its deadline on a loaded 2-core machine.
SLACK_S = 1.5

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[DribblingServer]:
    server = DribblingServer(byte_interval_s=0.2)
    yield server
    server.close()


@pytest.fixture
def store(server: DribblingServer) -> Iterator[RedisBlockStore]:
    settings = RedisStoreSettings(
        url=server.url,
        load_timeout_s=DEADLINE_S,
        save_timeout_s=DEADLINE_S,
        lookup_timeout_s=DEADLINE_S,
        retry_interval_s=0.01,
    )
    store = RedisBlockStore(settings)
    yield store
    store.close()


def _saved(store: RedisBlockStore, count: int) -> list[str]:
    keys = store_keys(LAYOUT, count)
    entries = [memoryview(encoded_entry(LAYOUT, index)) for index in range(count)]
    assert store.put(keys, entries) == [True] * count
    return keys


def _buffers(count: int) -> list[memoryview]:
    return [memoryview(bytearray(LAYOUT.entry_bytes)) for _ in range(count)]


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


@pytest.mark.slow
def test_a_load_the_server_dribbles_fails_at_the_load_deadline(
    server: DribblingServer, store: RedisBlockStore
) -> None:
    keys = _saved(store, 2)
    server.slow.add(b"GET")

    sizes, elapsed = _timed(lambda: store.get_into(keys, _buffers(2)))

    assert sizes == [None, None]
    assert elapsed < DEADLINE_S + SLACK_S
    assert store.counters()["load_failures"] == 2


@pytest.mark.slow
def test_a_connection_left_mid_reply_by_the_deadline_is_dropped_not_reused(
    server: DribblingServer, store: RedisBlockStore
) -> None:
    keys = _saved(store, 1)
    server.slow.add(b"GET")
    assert store.get_into(keys, _buffers(1)) == [None]

    server.slow.clear()
    # The client closed that connection: the server's next byte of the reply finds it gone.
    deadline = time.monotonic() + 10
    while server.replies_cut_off == 0:
        assert time.monotonic() < deadline, "the connection left mid-reply was kept open"
        time.sleep(0.01)
    wait_until_available(store)

    # Had the connection been reused, this load would read the rest of the old reply.
    buffers = _buffers(1)
    assert store.get_into(keys, buffers) == [LAYOUT.entry_bytes]
    verify_entry(buffers[0], LAYOUT, block_hash(0))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "call", "answer"),
    [
        pytest.param(b"EXISTS", lambda store, keys: store.count_prefix(keys), 0, id="lookup"),
        pytest.param(
            b"SET",
            lambda store, keys: store.put(keys, [memoryview(encoded_entry(LAYOUT, 0))]),
            [False],
            id="save",
        ),
        pytest.param(b"UNLINK", lambda store, keys: store.delete(keys), 0, id="delete"),
    ],
)
def test_every_other_call_the_server_dribbles_ends_at_its_deadline(
    server: DribblingServer,
    store: RedisBlockStore,
    command: bytes,
    call: Callable[[RedisBlockStore, list[str]], object],
    answer: object,
) -> None:
    keys = _saved(store, 1)
    server.slow.add(command)

    result, elapsed = _timed(lambda: call(store, keys))

    assert result == answer
    assert elapsed < DEADLINE_S + SLACK_S
    assert not store.is_available  # a server this slow is treated as down until it answers


@pytest.mark.slow
def test_a_handshake_the_server_dribbles_ends_at_the_connect_timeout(
    server: DribblingServer,
) -> None:
    # redis-py's handshake on a new connection: CLIENT SETINFO, answered "+OK" a byte a second.
    server.slow.add(b"CLIENT")
    server.byte_interval_s = 1.0
    store = RedisBlockStore(
        RedisStoreSettings(url=server.url, connect_timeout_s=DEADLINE_S, retry_interval_s=3600)
    )

    present, elapsed = _timed(lambda: store.count_prefix(store_keys(LAYOUT, 1)))

    assert present == 0
    assert elapsed < DEADLINE_S + SLACK_S
    assert not store.is_available
    store.close()


@pytest.mark.slow
def test_the_engine_recomputes_the_blocks_whose_load_ran_past_the_deadline(
    server: DribblingServer,
) -> None:
    workload = shared_prefix_workload()
    expected = tokens_of(generate(tiny_config(), workload))
    config = with_redis(tiny_config(), server.url, "kvwire:", load_timeout_s=DEADLINE_S)
    assert tokens_of(generate(config, workload)) == expected  # saves the prefix
    server.slow.add(b"GET")

    outputs, stats = generate_with_stats(config, workload)

    assert tokens_of(outputs) == expected
    assert stats["load_errors"] > 0
    assert stats.get("blocks_loaded", 0) == 0
