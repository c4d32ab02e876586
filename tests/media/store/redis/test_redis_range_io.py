"""RedisBlockStore's range I/O against a real redis-server: blocks straight to and from a cache.

Each entry is given as byte ranges: a small header buffer, then the block's
ranges strided through one shared "cache" buffer, as block_memory lays out
a paged KV cache. A save sends them as they are; a load scatters each reply
over them. Neither goes through the default's scratch buffer.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from kvwire.exceptions import JobAbandoned
from kvwire.media.store import base as store_module
from kvwire.media.store.base import BlockStore, CacheWrites
from kvwire.media.store.redis.cluster import RedisClusterBlockStore
from kvwire.media.store.redis.server import READ_GROUP_BYTES, RedisBlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings
from tests.support.redis import DribblingServer, LocalCluster, RedisServer

MakeStore = Callable[..., RedisBlockStore]
_Result = TypeVar("_Result")

HEADER_BYTES = 64
DEADLINE_S = 0.5
# Time a call may take beyond its deadline on a loaded 2-core machine.
SLACK_S = 1.5


class Cache:
    """``blocks`` blocks of ``layers`` ranges of ``range_bytes`` each, strided as in a paged cache.

    Range ``layer`` of block ``block`` sits at ``(layer * blocks + block) * range_bytes``:
    a block's ranges are never adjacent, so a store that joined them would be caught.
    """

    def __init__(self, blocks: int, layers: int, range_bytes: int) -> None:
        self.blocks, self.layers, self.range_bytes = blocks, layers, range_bytes
        self.memory = bytearray(blocks * layers * range_bytes)
        self.headers = [bytearray(HEADER_BYTES) for _ in range(blocks)]

    def ranges(self, block: int) -> list[memoryview]:
        view = memoryview(self.memory)
        starts = [(layer * self.blocks + block) * self.range_bytes for layer in range(self.layers)]
        return [memoryview(self.headers[block])] + [
            view[start : start + self.range_bytes] for start in starts
        ]

    def all_ranges(self) -> list[list[memoryview]]:
        return [self.ranges(block) for block in range(self.blocks)]

    @property
    def entry_bytes(self) -> int:
        return HEADER_BYTES + self.layers * self.range_bytes

    def fill_randomly(self) -> None:
        self.memory[:] = os.urandom(len(self.memory))
        for header in self.headers:
            header[:] = os.urandom(HEADER_BYTES)

    def entry(self, block: int) -> bytes:
        """What the store should hold for ``block``: its ranges joined, in order."""
        return b"".join(bytes(part) for part in self.ranges(block))

    def snapshot(self) -> bytes:
        return bytes(self.memory) + b"".join(bytes(header) for header in self.headers)


def _keys(count: int) -> list[str]:
    return [f"layout/{index:04d}" for index in range(count)]


def _without_default_scratch(call: Callable[[], _Result]) -> _Result:
    """``call()`` on a fresh thread; fails if it went through BlockStore's default scratch."""
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(call())
            # The default range I/O grows this thread's scratch buffer to an entry or more.
            assert len(store_module._scratch.buffer) == 0, "went through the staging scratch"
        except BaseException as error:  # handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def _load(
    store: BlockStore, keys: list[str], cache: Cache, writes: CacheWrites | None = None
) -> list[int | None]:
    """The sizes ``read_into_ranges`` yields, in order (checked to skip the default's scratch)."""

    def load() -> list[int | None]:
        landed = store.read_into_ranges(keys, cache.all_ranges(), writes)
        sizes: list[int | None] = []
        with contextlib.closing(landed):
            for index, size in landed:
                assert index == len(sizes)
                sizes.append(size)
        return sizes

    return _without_default_scratch(load)


def _save(store: BlockStore, keys: list[str], cache: Cache) -> list[bool]:
    """What ``write_ranges`` stored (checked to skip the default's scratch)."""
    return _without_default_scratch(lambda: store.write_ranges(keys, cache.all_ranges()))


@pytest.mark.parametrize(
    ("blocks", "layers", "range_bytes"),
    [
        pytest.param(3, 2, 1000, id="small"),
        # 48 entries of 256 KiB: several groups of GETs, socket buffers filled many times over.
        pytest.param(48, 8, 32 * 1024, id="many-keys"),
        pytest.param(4, 33, 32 * 1024 + 7, id="odd-1MiB"),
        # One entry of 6 MiB, more ranges than one recvmsg_into/sendmsg takes.
        pytest.param(1, 768, 8 * 1024, id="6MiB-768-ranges"),
    ],
)
def test_blocks_saved_from_their_ranges_load_back_bit_exact_without_staging(
    make_redis_store: MakeStore,
    redis_server: RedisServer,
    blocks: int,
    layers: int,
    range_bytes: int,
) -> None:
    store = make_redis_store()
    saved, loaded = Cache(blocks, layers, range_bytes), Cache(blocks, layers, range_bytes)
    saved.fill_randomly()
    keys = _keys(blocks)

    stored = _save(store, keys, saved)
    sizes = _load(store, keys, loaded)

    assert stored == [True] * blocks
    assert sizes == [saved.entry_bytes] * blocks
    assert loaded.snapshot() == saved.snapshot()
    # On the server, each value is the block's ranges in order.
    client = redis_server.client()
    assert client.get(store.redis_key(keys[-1])) == saved.entry(blocks - 1)


def test_a_load_of_more_groups_than_fit_one_pipeline_stays_in_step(
    make_redis_store: MakeStore,
) -> None:
    # Two groups in flight at most: pipeline_bytes of two entries makes every entry a group.
    cache = Cache(6, 4, 64 * 1024)
    store = make_redis_store(pipeline_bytes=2 * cache.entry_bytes)
    cache.fill_randomly()
    keys = _keys(6)
    assert _save(store, keys, cache) == [True] * 6
    assert cache.entry_bytes < READ_GROUP_BYTES
    loaded = Cache(6, 4, 64 * 1024)

    assert _load(store, keys, loaded) == [cache.entry_bytes] * 6
    assert loaded.snapshot() == cache.snapshot()


def test_over_tls_ranges_go_one_at_a_time_and_still_round_trip(
    tls_url: str, make_redis_store: MakeStore
) -> None:
    store = make_redis_store(url=tls_url, tls_verify=False)
    saved, loaded = Cache(5, 6, 40 * 1024 + 3), Cache(5, 6, 40 * 1024 + 3)
    saved.fill_randomly()
    keys = _keys(5)

    assert _save(store, keys, saved) == [True] * 5
    assert _load(store, keys, loaded) == [saved.entry_bytes] * 5
    assert loaded.snapshot() == saved.snapshot()


def test_a_value_longer_than_its_ranges_writes_nothing_and_is_deleted(
    make_redis_store: MakeStore, redis_server: RedisServer
) -> None:
    store = make_redis_store()
    cache = Cache(3, 4, 50 * 1024)
    keys = _keys(3)
    client = redis_server.client()
    client.set(store.redis_key(keys[0]), os.urandom(cache.entry_bytes))
    client.set(store.redis_key(keys[1]), os.urandom(cache.entry_bytes + 1))
    client.set(store.redis_key(keys[2]), os.urandom(cache.entry_bytes))
    loaded = Cache(3, 4, 50 * 1024)
    loaded.memory[:] = b"\xaa" * len(loaded.memory)
    before = loaded.ranges(1)

    assert _load(store, keys, loaded) == [cache.entry_bytes, None, cache.entry_bytes]

    assert all(bytes(part) == b"\xaa" * len(part) for part in before[1:])
    assert bytes(before[0]) == bytes(HEADER_BYTES)
    assert store.counters()["loads_oversized"] == 1
    assert client.exists(store.redis_key(keys[1])) == 0
    assert store.take_removed_keys() == [keys[1]]


def test_a_value_shorter_than_its_ranges_reports_its_length_and_writes_nothing_past_it(
    make_redis_store: MakeStore, redis_server: RedisServer
) -> None:
    store = make_redis_store()
    cache = Cache(2, 4, 50 * 1024)
    keys = _keys(2)
    short = os.urandom(HEADER_BYTES + 50 * 1024 + 10)
    redis_server.client().set(store.redis_key(keys[0]), short)
    cache.memory[:] = b"\xaa" * len(cache.memory)

    assert _load(store, keys, cache) == [len(short), None]

    ranges = cache.ranges(0)
    assert bytes(ranges[0]) + bytes(ranges[1]) + bytes(ranges[2][:10]) == short
    assert bytes(ranges[2][10:]) + bytes(ranges[3]) + bytes(ranges[4]) == b"\xaa" * (
        3 * 50 * 1024 - 10
    )


class _GivenUpAfter(CacheWrites):
    """A load the connector gives up on before its ``writes``-th write into the cache.

    ``at_close`` is the cache as it was when the load was given up on.
    """

    def __init__(self, writes: int, cache: Cache) -> None:
        super().__init__()
        self._left = writes
        self._cache = cache
        self.at_close: bytes | None = None

    def writing(self) -> contextlib.AbstractContextManager[None]:
        self._left -= 1
        if self._left == 0:
            self.at_close = self._cache.snapshot()
            self.close(grace_s=0)  # between two writes: none is under way
        return super().writing()


def test_a_load_given_up_mid_entry_writes_nothing_into_the_cache_afterwards(
    make_redis_store: MakeStore,
) -> None:
    store = make_redis_store()
    saved = Cache(2, 128, 32 * 1024)  # two 4 MiB entries
    saved.fill_randomly()
    keys = _keys(2)
    assert _save(store, keys, saved) == [True, True]
    loaded = Cache(2, 128, 32 * 1024)
    writes = _GivenUpAfter(3, loaded)

    with pytest.raises(JobAbandoned):
        _load(store, keys, loaded, writes)

    # Given up on inside the first entry: part of it had landed, nothing after.
    assert writes.at_close is not None
    assert loaded.snapshot() == writes.at_close
    assert loaded.entry(0) != saved.entry(0)
    assert loaded.entry(1) == bytes(loaded.entry_bytes)
    # The connection, left mid-reply, was dropped: the next load reads whole entries.
    again = Cache(2, 128, 32 * 1024)
    assert _load(store, keys, again) == [saved.entry_bytes] * 2
    assert again.snapshot() == saved.snapshot()


def test_a_load_given_up_before_it_starts_writes_nothing(make_redis_store: MakeStore) -> None:
    store = make_redis_store()
    saved = Cache(2, 4, 1024)
    saved.fill_randomly()
    keys = _keys(2)
    assert _save(store, keys, saved) == [True, True]
    loaded = Cache(2, 4, 1024)
    writes = CacheWrites()
    writes.close(grace_s=0)

    with pytest.raises(JobAbandoned):
        _load(store, keys, loaded, writes)

    assert loaded.snapshot() == Cache(2, 4, 1024).snapshot()


def test_a_server_dying_in_the_middle_of_a_ranged_read_fails_the_entries_not_yet_read(
    fault_server: RedisServer,
) -> None:
    cache = Cache(3, 4, 16 * 1024)
    # One entry per group of GETs: entry 2 is asked for only once entry 1 is read.
    store = RedisBlockStore(
        RedisStoreSettings(
            url=fault_server.url,
            key_prefix="ranges:",
            retry_interval_s=3600,
            pipeline_bytes=2 * cache.entry_bytes,
        )
    )
    cache.fill_randomly()
    keys = _keys(3)
    assert _save(store, keys, cache) == [True] * 3
    loaded = Cache(3, 4, 16 * 1024)
    landed = store.read_into_ranges(keys, loaded.all_ranges())
    assert _without_default_scratch(lambda: next(landed)) == (0, cache.entry_bytes)

    fault_server.kill()

    rest = list(landed)
    assert [index for index, _ in rest] == [1, 2]
    assert rest[-1] == (2, None)
    assert loaded.entry(0) == cache.entry(0)
    assert store.counters()["load_failures"] == sum(size is None for _, size in rest)
    assert not store.is_available
    # Saves during the outage are dropped, not raised.
    assert store.write_ranges(keys[:1], cache.all_ranges()[:1]) == [False]
    store.close()


@pytest.fixture
def dribbling_server() -> Iterator[DribblingServer]:
    server = DribblingServer(byte_interval_s=0.2)
    yield server
    server.close()


def _timed(call: Callable[[], _Result]) -> tuple[_Result, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_ranged_loads_and_saves_the_server_dribbles_end_at_their_deadlines(
    dribbling_server: DribblingServer,
) -> None:
    settings = RedisStoreSettings(
        url=dribbling_server.url,
        load_timeout_s=DEADLINE_S,
        save_timeout_s=DEADLINE_S,
        retry_interval_s=3600,
    )
    cache = Cache(2, 4, 1024)
    keys = _keys(2)
    saver, loader = RedisBlockStore(settings), RedisBlockStore(settings)
    assert _save(saver, keys, cache) == [True, True]
    dribbling_server.slow.update({b"GET", b"SET"})

    sizes, load_seconds = _timed(lambda: _load(loader, keys, Cache(2, 4, 1024)))
    stored, save_seconds = _timed(lambda: _save(saver, keys, cache))

    assert sizes == [None, None]
    assert loader.counters()["load_failures"] == 2
    assert stored == [False, False]
    assert saver.counters()["saves_dropped"] == 2
    assert load_seconds < DEADLINE_S + SLACK_S
    assert save_seconds < DEADLINE_S + SLACK_S
    saver.close()
    loader.close()


@pytest.mark.slow
def test_the_cluster_store_moves_ranges_through_each_masters_store(
    redis_cluster: LocalCluster,
) -> None:
    store = RedisClusterBlockStore(
        RedisStoreSettings(url=redis_cluster.url, key_prefix="kvwire-test:ranges:")
    )
    saved, loaded = Cache(30, 4, 20 * 1024 + 1), Cache(30, 4, 20 * 1024 + 1)
    saved.fill_randomly()
    keys = _keys(30)
    try:
        assert _save(store, keys, saved) == [True] * 30
        assert len(store.masters()) > 1
        sizes = _load(store, keys, loaded)

        assert sizes == [saved.entry_bytes] * 30
        assert loaded.snapshot() == saved.snapshot()
        given_up = CacheWrites()
        given_up.close(grace_s=0)
        untouched = Cache(30, 4, 20 * 1024 + 1)
        with pytest.raises(JobAbandoned):
            _load(store, keys, untouched, given_up)
        assert untouched.snapshot() == Cache(30, 4, 20 * 1024 + 1).snapshot()
    finally:
        store.clear()
        store.close()


class _ClosesAfter(CacheWrites):
    """A save's gate, closed (as the connector would) when entry ``checks + 1`` asks it."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self._left = checks

    def is_open(self) -> bool:
        if self._left == 0:
            self.close(grace_s=0)
        self._left -= 1
        return super().is_open()


def test_a_save_whose_gate_closes_completes_no_set_after_it(
    make_redis_store: MakeStore, redis_server: RedisServer
) -> None:
    # One connection: the one left mid-command must be dropped, never reused as it is.
    store = make_redis_store(pool_size=1)
    cache = Cache(3, 4, 32 * 1024)
    cache.fill_randomly()
    keys = _keys(3)
    client = redis_server.client()
    # Another engine's entry under the last key: a save given up on must not replace it.
    client.set(store.redis_key(keys[2]), b"another engine's entry")

    stored = _without_default_scratch(
        lambda: store.write_ranges(keys, cache.all_ranges(), _ClosesAfter(1))
    )

    assert stored == [True, False, False]
    assert client.get(store.redis_key(keys[0])) == cache.entry(0)
    assert client.get(store.redis_key(keys[1])) is None
    assert client.get(store.redis_key(keys[2])) == b"another engine's entry"
    assert _save(store, keys, cache) == [True] * 3
    assert client.get(store.redis_key(keys[2])) == cache.entry(2)
