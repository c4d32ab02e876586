"""Block stores for the store tests.

Store handlers over real paged caches; plug-in stores that answer truthfully,
fail mid-run or hold their writes; and what every store connector does on a
hybrid cache.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.memory import BlockMemory
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config.extra_config import ExtraConfigKey, str_key
from kvwire.connectors.offload import OffloadConnector, SharedStorageConnector
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockStored, Request, SchedulerOutput
from kvwire.media.store._handler import StoreTransferHandler
from kvwire.media.store.base import BlockStore
from kvwire.media.store.directory import DirectoryMedium
from kvwire.media.store.medium import StoreMedium
from tests.support.media import DrivenHandler
from tests.support.pairs import (
    A_IDS,
    B_IDS,
    BLOCK,
    FULL,
    FULL_LAYERS,
    PROMPT,
    SLIDING,
    SLIDING_LAYERS,
    HybridPair,
    make_request,
    zero,
)
from tests.support.pairs import (
    NUM_BLOCKS as HYBRID_NUM_BLOCKS,
)

# A plug-in ``BlockStore`` that answers truthfully from one process-wide dict.
#
# Both roles' stores share the dict on purpose: the scheduler's lookups see
# the worker's saves, as they would through a real shared store. A test module
# that needs entries of its own subclasses it with an ``entries`` dict of its
# own; stores that misbehave subclass it and override one call.


class DictStore(BlockStore):
    """Entries in one process-wide dict, answered truthfully."""

    entries: ClassVar[dict[str, bytes]] = {}
    lock = threading.Lock()

    def count_prefix(self, keys: Sequence[str]) -> int:
        with self.lock:
            held = 0
            while held < len(keys) and keys[held] in self.entries:
                held += 1
            return held

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        with self.lock:
            for key, entry in zip(keys, entries, strict=True):
                self.entries[key] = bytes(entry)
        return [True] * len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sizes: list[int | None] = []
        with self.lock:
            for key, buffer in zip(keys, buffers, strict=True):
                entry = self.entries.get(key)
                if entry is None or len(entry) > len(buffer):
                    sizes.append(None)
                    continue
                buffer[: len(entry)] = entry
                sizes.append(len(entry))
        return sizes


# Plug-in stores that fail mid-run as a third-party store can, each named after how.
#
# Each keeps entries in one process-wide dict like an honest store, and
# misbehaves in one call: the engine must carry on with the outputs it would
# have without a connector, warn in one line naming the store's call, and
# never show the secret the store's message quotes.

SECRET = "hunter2-secret"
LEAKY_MESSAGE = f"lost redis://u:{SECRET}@h (password={SECRET})"


class RaisingStore(DictStore):
    """Its ``put`` and ``get_into`` raise, quoting a URL with its password."""

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        raise ConnectionError(LEAKY_MESSAGE)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        raise ConnectionError(LEAKY_MESSAGE)


class ExitingStore(DictStore):
    """Its ``put`` and ``get_into`` call ``sys.exit()``, as a careless client library might."""

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        sys.exit(LEAKY_MESSAGE)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sys.exit(LEAKY_MESSAGE)


class ShortReplyStore(DictStore):
    """Stores every entry, but its ``put`` answers one result fewer than the keys it got."""

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        return super().put(keys, entries)[:-1]


class RaisingRemovedKeysStore(DictStore):
    """Its ``take_removed_keys``, asked after every save, raises."""

    def take_removed_keys(self) -> list[str]:
        raise ConnectionError(LEAKY_MESSAGE)


class RaisingDiscardStore(DictStore):
    """Its ``discard``, asked to drop the entries a reader found corrupt, raises."""

    def discard(self, keys: Sequence[str]) -> None:
        raise ConnectionError(LEAKY_MESSAGE)


class DictMedium(StoreMedium[DictStore]):
    """A third-party medium over whichever store class ``store_class`` names."""

    event_medium = "plugin-store"
    store_class: ClassVar[type[DictStore]] = DictStore

    def create_store(self, options: Mapping[str, Any]) -> DictStore:
        return self.store_class()


class RaisingMedium(DictMedium):
    store_class = RaisingStore


class ExitingMedium(DictMedium):
    store_class = ExitingStore


class ShortReplyMedium(DictMedium):
    store_class = ShortReplyStore


class RaisingRemovedKeysMedium(DictMedium):
    store_class = RaisingRemovedKeysStore


class RaisingDiscardMedium(DictMedium):
    store_class = RaisingDiscardStore


# Store workers over real paged caches, for tests of the worker-side data path.

NUM_BLOCKS = 4


def layout_caches(
    layout: BlockLayout, seed: int | None, num_blocks: int = NUM_BLOCKS
) -> dict[str, torch.Tensor]:
    """Paged caches of ``num_blocks`` blocks in ``layout``: zeros, or random from ``seed``."""
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size)
    if seed is None:
        return {f"layers.{i}": torch.zeros(shape) for i in range(layout.num_layers)}
    generator = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}": torch.randn(shape, generator=generator) for i in range(layout.num_layers)
    }


def store_worker(
    store: BlockStore, layout: BlockLayout, caches: dict[str, torch.Tensor]
) -> DrivenHandler[StoreTransferHandler]:
    """A one-thread worker, keyed by the layout's own keys, driven as the connector drives it."""
    handler = StoreTransferHandler(
        store=store,
        layouts=(layout,),
        memories=(BlockMemory(caches, layout, sorted(caches)),),
        io_threads=1,
        batch_blocks=2,
        max_save_bytes=2 * layout.entry_bytes,
        counters=Counters(),
        medium="test",
    )
    return DrivenHandler(handler)


HASHES = (b"\x01" * 32, b"\x02" * 32)
"""The block hashes blocks 0 and 1 are saved under, and blocks 2 and 3 loaded from."""


def save_blocks_0_and_1(
    store: BlockStore, layout: BlockLayout, seed: int
) -> dict[str, torch.Tensor]:
    """A producer's random caches; its blocks 0 and 1 are now in ``store`` under ``HASHES``."""
    caches = layout_caches(layout, seed=seed)
    producer = store_worker(store, layout, caches)
    producer.save([BlockTransfer(request_id="p", block_ids=(0, 1), block_hashes=HASHES)])
    assert producer.wait_for_saves(30)
    producer.close()
    return caches


def load_into_blocks_2_and_3(
    store: BlockStore, layout: BlockLayout
) -> tuple[dict[str, torch.Tensor], set[int]]:
    """A consumer's caches after loading ``HASHES`` into blocks 2 and 3, and its load errors."""
    caches = layout_caches(layout, seed=None)
    consumer = store_worker(store, layout, caches)
    consumer.start_loads([BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], [])
    errors = consumer.take_load_errors()
    consumer.close()
    return caches, errors


# Shared storage whose writes wait while a file exists: saves that outlive their requests.
#
# ``kv_connector_extra_config.hold_path`` names the file. While it exists,
# every write waits (in the connector's background save threads, as a slow
# medium would); a test creates it to hold saves back and removes it to let
# them through, from any process, so this works with the worker in its own
# process too.

HOLD_LIMIT_S = 60.0
"""A test that never removes the file fails its writes after this, rather than hanging."""


class HeldStore(BlockStore):
    """``store``, with every ``put`` waiting while ``hold_path`` exists."""

    def __init__(self, store: BlockStore, hold_path: str) -> None:
        self._store = store
        self._hold_path = hold_path
        self.medium = store.medium

    def count_prefix(self, keys: Sequence[str]) -> int:
        return self._store.count_prefix(keys)

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        deadline = time.monotonic() + HOLD_LIMIT_S
        while os.path.exists(self._hold_path):
            if time.monotonic() > deadline:
                return [False] * len(keys)
            time.sleep(0.001)
        return self._store.put(keys, entries)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return self._store.get_into(keys, buffers)

    def read_each(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> Generator[tuple[int, int | None], None, None]:
        return self._store.read_each(keys, buffers)

    def discard(self, keys: Sequence[str]) -> None:
        self._store.discard(keys)

    def close(self) -> None:
        self._store.close()


class HeldDirectory(DirectoryMedium):
    """The directory medium over a :class:`HeldStore`; ``hold_path`` names the file."""

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return (*super().extra_config_keys(), str_key("hold_path", None, required=True))

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        return HeldStore(super().create_store(options), options["hold_path"])


class HeldSharedStorageConnector(SharedStorageConnector):
    """The shared-storage connector over a :class:`HeldDirectory`.

    Named by module path, so a worker process resolves the medium too.
    """

    default_medium = f"{__name__}:{HeldDirectory.__name__}"


# What every store connector does on a hybrid cache: a full-attention group and a sliding one.
#
# :class:`StoreGroupsContract` holds the tests; a store's test module subclasses
# it as ``Test...`` and gives it a ``hybrid`` fixture building
# :class:`HybridStorePair` objects on that store (shared storage here, a real
# Redis server in ``tests/redis``), so every store is held to the same rules.
#
# The hybrid cache and the pair's steps are ``tests.support.pairs``'s,
# shared with CPU offload's tests.


def store_medium(connector: OffloadConnector) -> StoreMedium[Any]:
    """``connector``'s medium, a store medium (its store, keys and layouts)."""
    medium = connector.medium
    assert isinstance(medium, StoreMedium), medium
    return medium


class HybridStorePair(HybridPair[OffloadConnector]):
    """A scheduler-role and a worker-role store connector over a hybrid cache."""

    @property
    def medium(self) -> StoreMedium[Any]:
        """The scheduler-role connector's store medium."""
        return store_medium(self.scheduler)

    def save_all(self) -> None:
        assert self.worker.wait_for_pending_saves(30)
        self.step(SchedulerOutput())  # so the saves' stats and events are reported


HybridFactory = Callable[..., HybridStorePair]


def offload(pair: HybridStorePair, request_id: str = "a", prompt: list[int] = PROMPT) -> Request:
    """Prefill request ``a`` in ``A_IDS`` with nothing stored yet; its saves are in the store."""
    request = make_request(request_id, prompt, BLOCK)
    assert pair.prefill_groups(request, A_IDS) == (0, False)
    # Its saves read its blocks in place: kept until they end, then finished sending.
    assert pair.finish_groups(request, A_IDS) is True
    assert request.request_id in pair.finished_sending
    pair.save_all()
    return request


class StoreGroupsContract:
    """The rules on a hybrid cache; a subclass provides the ``hybrid`` fixture."""

    @pytest.fixture
    def pairs(self) -> Iterator[list[HybridStorePair]]:
        opened: list[HybridStorePair] = []
        yield opened
        for pair in opened:
            pair.shutdown()

    @pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
    def test_each_group_round_trips_bit_exact_into_other_block_ids(
        self, hybrid: HybridFactory, async_load: bool
    ) -> None:
        pair = hybrid(async_load=async_load, io_threads=2)
        offload(pair)
        zero(pair, B_IDS)
        before = {name: cache.clone() for name, cache in pair.caches.items()}
        b = make_request("b", PROMPT, BLOCK)
        assert pair.prefill_groups(b, B_IDS) == (24, async_load)
        pair.step_until(lambda: not async_load or "b" in pair.finished_recving)
        assert pair.load_errors == set()
        loaded = {
            FULL: dict(zip(A_IDS[FULL][:6], B_IDS[FULL][:6], strict=True)),
            SLIDING: {12: 32, 13: 33},
        }
        for group, moves in loaded.items():
            for source, target in moves.items():
                for got, want in zip(
                    pair.group_blocks(group, target), pair.group_blocks(group, source), strict=True
                ):
                    assert torch.equal(got, want), f"group {group}: block {source} -> {target}"
        # Only group g's layers at group g's loaded ids changed; the null block too stayed.
        written = {(name, block) for name in FULL_LAYERS for block in loaded[FULL].values()}
        written |= {(name, block) for name in SLIDING_LAYERS for block in loaded[SLIDING].values()}
        for name, cache in pair.caches.items():
            for block in range(HYBRID_NUM_BLOCKS):
                if (name, block) not in written:
                    assert torch.equal(cache[:, block], before[name][:, block]), (name, block)
        assert pair.stats["blocks_loaded"] == 8

    @pytest.mark.parametrize(
        ("prompt", "window"),
        [(PROMPT, [4, 5]), (PROMPT[:24], [3, 4, 5])],
        ids=["25", "24-aligned"],
    )
    def test_the_sliding_group_stores_only_its_window_and_the_block_before_on_a_boundary(
        self, hybrid: HybridFactory, prompt: list[int], window: list[int]
    ) -> None:
        pair = hybrid()
        a = offload(pair, prompt=prompt)
        assert pair.held(FULL, a, range(6)) == [0, 1, 2, 3, 4, 5]
        # The window at the prefix's end (4-5); when the prefix ends a block,
        # the block before it too (the window a block earlier, where a prompt
        # equal to a's prefix hits, its last token recomputed).
        assert pair.held(SLIDING, a, range(6)) == window
        assert pair.stats["blocks_saved"] == 6 + len(window)
        # Events name blocks by hash and group: the full group's six, the sliding group's window.
        stored: dict[int | None, list[bytes]] = {}
        for event in pair.worker.get_kv_connector_kv_cache_events():
            if isinstance(event, BlockStored):
                stored.setdefault(event.group, []).extend(event.block_hashes)
        assert {group: sorted(hashes) for group, hashes in stored.items()} == {
            FULL: sorted(a.block_hashes[:6]),
            SLIDING: sorted(a.block_hashes[window[0] : 6]),
        }

    def test_the_null_block_is_never_read_or_written(self, hybrid: HybridFactory) -> None:
        pair = hybrid()
        # While a decodes, positions 0-3 of its sliding group have left the window.
        a = make_request("a", PROMPT, BLOCK)
        ids = (A_IDS[FULL], [0, 0, 0, 0, 12, 13, 14])
        pair.prefill_groups(a, ids)
        pair.finish_groups(a, ids)
        pair.save_all()
        assert pair.held(SLIDING, a, range(6)) == [4, 5]
        null_before = [cache[:, 0].clone() for cache in pair.caches.values()]
        b = make_request("b", PROMPT, BLOCK)
        assert pair.prefill_groups(b, B_IDS) == (24, False)
        assert pair.stats["blocks_saved"] == 8
        assert pair.stats["blocks_loaded"] == 8
        assert all(
            torch.equal(cache[:, 0], before)
            for cache, before in zip(pair.caches.values(), null_before, strict=True)
        )

    def test_a_gap_in_the_sliding_window_moves_the_hit_back(self, hybrid: HybridFactory) -> None:
        pair = hybrid()
        a = make_request("a", PROMPT, BLOCK)
        pair.admit(a, A_IDS)
        # Chunked: 2 blocks, then the rest; the sliding group saves positions 0-1,
        # then 4-5 (the window at the end, inside block 6: not the block
        # before), leaving out 2-3.
        pair.compute(a, A_IDS, 0, 8, is_new=True)
        pair.compute(a, A_IDS, 8, len(PROMPT) - 8, is_new=False)
        pair.finish_groups(a, A_IDS)
        pair.save_all()
        assert pair.held(SLIDING, a, range(6)) == [0, 1, 4, 5]
        # Sharing a's first 4 blocks: the full group holds all 4, but a prefix of
        # 4 needs positions 2-3 in the sliding group; of 2, positions 0-1, held.
        d = make_request("d", PROMPT[:16] + [7] * 9, BLOCK)
        assert pair.index.count_held_prefix(FULL, d.block_hashes) == 4
        assert pair.lookup(d) == (8, False)
        # Sharing 3: positions 1-2 are needed and 2 is missing; sharing 5:
        # positions 3-4, and 3 is missing: both back to 2 blocks.
        c = make_request("c", PROMPT[:12] + [7] * 13, BLOCK)
        assert pair.lookup(c) == (8, False)
        e = make_request("e", PROMPT[:20] + [7] * 5, BLOCK)
        assert pair.lookup(e) == (8, False)
        # Sharing 6: positions 4-5 are needed, past the gap: all 6 blocks.
        f = make_request("f", [*PROMPT[:24], 7], BLOCK)
        assert pair.lookup(f) == (24, False)

    def test_groups_name_their_entries_apart(self, hybrid: HybridFactory) -> None:
        pair = hybrid()
        block_hash = b"\x07" * 32
        keys = [pair.medium.store_key(block_hash, group) for group in (FULL, SLIDING)]
        assert keys[0] != keys[1]
        # Removed keys map back to their block hash, whichever group's they are.
        worker_medium = store_medium(pair.worker)
        assert [worker_medium.block_hash_of(key) for key in keys] == [block_hash, block_hash]

    def test_an_entry_of_one_group_is_never_loaded_into_another(
        self, hybrid: HybridFactory
    ) -> None:
        pair = hybrid()
        a = offload(pair)
        # Forge: the full group's entry of position 5 put under the sliding group's key.
        store = pair.medium.store
        full_key = pair.medium.store_key(a.block_hashes[5], FULL)
        sliding_key = pair.medium.store_key(a.block_hashes[5], SLIDING)
        entry = bytearray(pair.medium.layout.entry_bytes)
        assert store.get_into([full_key], [memoryview(entry)]) == [len(entry)]
        assert store.put([sliding_key], [memoryview(entry)]) == [True]
        zero(pair, B_IDS)
        b = make_request("b", PROMPT, BLOCK)
        assert pair.prefill_groups(b, B_IDS) == (24, False)
        # Its header names the full group: refused and reported, never counted
        # loaded (read into block 33 and checked there: the engine computes it again).
        assert pair.load_errors == {33}
        assert pair.stats["corrupt_entries"] == 1
        assert pair.stats["load_errors"] == 1
        assert pair.held(SLIDING, a, range(6)) == [4]  # the forged entry is dropped
        assert pair.held(FULL, a, range(6)) == [0, 1, 2, 3, 4, 5]

    def test_a_request_keeps_its_blocks_while_an_async_load_writes_them(
        self, hybrid: HybridFactory
    ) -> None:
        pair = hybrid(async_load=True)
        offload(pair)
        b = make_request("b", PROMPT, BLOCK)
        assert pair.admit(b, B_IDS) == (24, True)
        # Finished before its loads (one per group) ran: kept until they end.
        assert pair.finish_groups(b, B_IDS) is True
        assert "b" in pair.finished_sending

    def test_reset_cache_forgets_every_groups_entries(self, hybrid: HybridFactory) -> None:
        pair = hybrid()
        a = offload(pair)
        assert pair.scheduler.reset_cache() is not False
        assert pair.held(FULL, a, range(6)) == []
        assert pair.held(SLIDING, a, range(6)) == []
