"""The CPU pool as a medium: its index and its transfer handler, driven directly (no connector).

The offload connector plans which blocks move; here each call it would make
is made by hand, so what the medium itself promises is what is checked:
bytes round-trip bit-exact, a block is a hit only once its store is made,
a full pool skips and counts, events come one per KV cache group, a corrupt
slot is forgotten, and a pool too small for one block is refused by name.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvwire.blocks.format import FLAG_NO_CHECKSUM, BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.paged_cache import PagedKVCaches
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config.extra_config import ExtraConfigError, read_extra_config
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockRemoved, BlockStored
from kvwire.media.base import MediumContext, MediumIndex, TransferHandler
from kvwire.media.cpu_pool import CPUPoolMedium
from kvwire.media.cpu_pool import handler as cpu_pool_handler_module
from kvwire.media.cpu_pool.handler import CPUPoolTransferHandler
from kvwire.media.cpu_pool.pool_memory import PoolSlots
from kvwire.media.eviction import LRUPolicy
from tests.support.media import DrivenHandler, name_another_block, name_another_layout
from tests.support.stores import HASHES, layout_caches
from tests.support.waits import TEST_LIMIT_S

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
# Where an entry's header holds its payload checksum and its flags.
CHECKSUM_AT = struct.calcsize("<4sHH16s32s5IQ")
FLAGS_AT = CHECKSUM_AT + 8
H1, H2 = HASHES
H3, H4, H5 = (bytes([n]) * 32 for n in (3, 4, 5))


def medium(slots: int, num_groups: int = 1, **extra: Any) -> CPUPoolMedium:
    """A medium whose pool holds ``slots`` entries; group ``g`` has layers ``2g`` and ``2g + 1``."""
    options = read_extra_config(
        "TestConnector",
        {"cpu_pool_bytes": slots * LAYOUT.entry_bytes, "io_threads": 1, **extra},
        CPUPoolMedium.extra_config_keys(),
    )
    groups = tuple(
        CacheGroup(g, (f"layers.{2 * g}", f"layers.{2 * g + 1}"), LAYOUT.block_size)
        for g in range(num_groups)
    )
    plugins = {"eviction": LRUPolicy}
    return CPUPoolMedium(MediumContext("TestConnector", options, groups, LAYOUT, plugins=plugins))


@pytest.fixture
def handlers() -> Iterator[list[DrivenHandler[TransferHandler]]]:
    """Handlers the test built; closed at teardown, so no copy thread outlives it."""
    built: list[DrivenHandler[TransferHandler]] = []
    yield built
    for handler in built:
        handler.close()


def pool_of(handler: DrivenHandler[TransferHandler]) -> CPUPoolTransferHandler:
    assert isinstance(handler, CPUPoolTransferHandler)
    return handler


def stored(index: MediumIndex, handler: DrivenHandler[TransferHandler]) -> tuple[int, ...]:
    """Blocks 0 and 1 stored and published under ``HASHES`` in group 0; their slots."""
    placed = index.prepare_save(0, HASHES)
    assert [block_hash for block_hash, _ in placed] == list(HASHES)
    slots = tuple(slot for _, slot in placed if slot is not None)
    handler.save(
        [BlockTransfer(request_id="p", block_ids=(0, 1), block_hashes=HASHES, slots=slots)]
    )
    assert handler.wait_for_saves(TEST_LIMIT_S)
    index.complete_save(0, HASHES, success=True)
    return slots


def load_into_2_and_3(index: MediumIndex, handler: DrivenHandler[TransferHandler]) -> set[int]:
    """Load ``HASHES`` of group 0 into blocks 2 and 3; the block ids that failed."""
    slots = index.prepare_load(0, HASHES).slots
    handler.start_loads(
        [BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES, slots=slots)], []
    )
    return handler.take_load_errors()


def bits(cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """The raw bits of one block of a layer's cache (so -0.0 and NaN compare exactly)."""
    return cache[:, block_id].contiguous().view(torch.int32)


# ----------------------------------------------------------------- the medium


def test_the_medium_declares_its_keys_and_sizes_its_pool_in_entries() -> None:
    defaults = read_extra_config("TestConnector", {}, CPUPoolMedium.extra_config_keys())
    assert defaults == {
        "cpu_pool_bytes": 256 * 1024**2,
        "io_threads": 2,
        "transfer_timeout_s": 30.0,
        "eviction": "kvfifo",
        "save_threshold": 1,
    }
    pool = medium(5)
    assert pool.num_slots == 5
    assert CPUPoolMedium.event_medium == "cpu"
    # A partial entry's bytes are no slot.
    extra = {"cpu_pool_bytes": 3 * LAYOUT.entry_bytes - 1}
    assert medium(1, **extra).num_slots == 2


def test_a_pool_too_small_for_one_block_names_the_key() -> None:
    too_small = LAYOUT.entry_bytes - 1
    with pytest.raises(
        ExtraConfigError,
        match=rf"kv_connector_extra_config\.cpu_pool_bytes: {too_small} bytes hold no block; "
        rf"expected at least {LAYOUT.entry_bytes} ",
    ):
        medium(1, cpu_pool_bytes=too_small)


def test_a_pool_size_that_is_no_size_names_the_key() -> None:
    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.cpu_pool_bytes"):
        medium(1, cpu_pool_bytes="plenty")


def test_async_load_is_the_connectors_key_not_the_mediums() -> None:
    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.async_load"):
        medium(1, async_load=True)


def test_the_handler_logs_the_pool_it_allocated(
    caplog: pytest.LogCaptureFixture, handlers: list[DrivenHandler[TransferHandler]]
) -> None:
    with caplog.at_level(logging.INFO, logger="kvwire.media.cpu_pool"):
        handlers.append(
            DrivenHandler(medium(4).build_handler(layout_caches(LAYOUT, seed=1), Counters()))
        )
    assert (
        f"TestConnector: a pool of 4 blocks of {LAYOUT.payload_bytes} bytes (0.0 MiB), "
        "1 KV cache groups" in caplog.text
    )


# ------------------------------------------------------ stores, then loads


def test_a_store_then_a_load_round_trips_the_blocks_bit_exact(
    handlers: list[DrivenHandler[TransferHandler]],
) -> None:
    pool = medium(4)
    caches = layout_caches(LAYOUT, seed=3)
    index = pool.build_index()
    handler = DrivenHandler(pool.build_handler(caches, Counters()))
    handlers.append(handler)

    stored(index, handler)
    assert index.count_held_prefix(0, HASHES) == 2
    assert load_into_2_and_3(index, handler) == set()
    index.complete_load(0, HASHES, corrupt=[])

    for cache in caches.values():
        assert torch.equal(bits(cache, 2), bits(cache, 0))
        assert torch.equal(bits(cache, 3), bits(cache, 1))
    assert index.take_events() == [BlockStored(block_hashes=HASHES, medium="cpu", group=0)]
    assert index.take_counters() == {}


def test_a_block_being_stored_is_no_hit_and_cannot_be_loaded() -> None:
    index = medium(4, num_groups=2).build_index()
    index.prepare_save(1, [H1])
    assert index.count_held_prefix(1, [H1]) == 0

    with pytest.raises(ValueError, match="holds 0 of the 1 blocks asked for in KV cache group 1"):
        index.prepare_load(1, [H1])


def test_a_refused_load_pins_nothing() -> None:
    index = medium(1).build_index()
    index.prepare_save(0, [H1])
    index.complete_save(0, [H1], success=True)

    with pytest.raises(ValueError, match="holds 1 of the 2 blocks asked for in KV cache group 0"):
        index.prepare_load(0, [H1, H2])

    # H1 is evictable: the one slot goes to H3.
    assert index.prepare_save(0, [H3]) == [(H3, 0)]


def test_a_store_completed_without_success_never_becomes_a_hit_and_frees_its_slot() -> None:
    index = medium(1).build_index()
    assert index.prepare_save(0, [H1]) == [(H1, 0)]

    index.complete_save(0, [H1], success=False)

    assert index.count_held_prefix(0, [H1]) == 0
    assert index.take_events() == []
    assert index.prepare_save(0, [H2]) == [(H2, 0)]
    assert index.take_counters() == {}  # the slot was free: nothing evicted, nothing skipped


def test_a_block_held_is_not_stored_again() -> None:
    index = medium(4).build_index()
    index.prepare_save(0, [H1])
    index.complete_save(0, [H1], success=True)

    assert index.prepare_save(0, [H1, H2]) == [(H2, 1)]
    assert index.take_counters() == {}


def test_a_full_pool_skips_stores_and_counts_them() -> None:
    index = medium(2).build_index()
    index.prepare_save(0, [H1, H2])  # being stored: neither can be evicted

    # H1 is held (not skipped); H3 and H4 find every slot in use.
    assert index.prepare_save(0, [H1, H3, H4]) == []

    assert index.take_counters() == {"stores_skipped_pool_full": 2}
    assert index.take_counters() == {}


def test_evictions_are_counted_and_reported_once_per_group() -> None:
    index = medium(3, num_groups=2).build_index()
    index.prepare_save(0, [H1])
    index.prepare_save(1, [H1, H2])
    index.complete_save(0, [H1], success=True)
    index.complete_save(1, [H1, H2], success=True)
    # One group's H1 and the other's are two entries, and two events.
    assert index.take_events() == [
        BlockStored(block_hashes=(H1,), medium="cpu", group=0),
        BlockStored(block_hashes=(H1, H2), medium="cpu", group=1),
    ]

    assert [block_hash for block_hash, _ in index.prepare_save(0, [H3, H4, H5])] == [H3, H4, H5]

    # A prefix goes from its tail: group 1's H2 before its H1.
    assert index.take_events() == [
        BlockRemoved(block_hashes=(H1,), medium="cpu", group=0),
        BlockRemoved(block_hashes=(H2, H1), medium="cpu", group=1),
    ]
    assert index.take_counters() == {"evicted_blocks": 3}
    assert index.count_held_prefix(1, [H1]) == 0


@pytest.mark.parametrize("mix_up", [name_another_block, name_another_layout])
def test_a_slot_naming_another_block_or_layout_is_never_loaded_and_is_discarded(
    handlers: list[DrivenHandler[TransferHandler]], mix_up: Callable[[PoolSlots, int], None]
) -> None:
    pool = medium(4)
    counters = Counters()
    index = pool.build_index()
    caches = layout_caches(LAYOUT, seed=4)
    handler = DrivenHandler(pool.build_handler(caches, counters))
    handlers.append(handler)
    slots = stored(index, handler)
    index.take_events()
    before = [bits(cache, 3).clone() for cache in caches.values()]
    mix_up(pool_of(handler.handler).pool, slots[1])

    assert load_into_2_and_3(index, handler) == {3}
    assert all(
        torch.equal(bits(cache, 3), old) for cache, old in zip(caches.values(), before, strict=True)
    )
    index.complete_load(0, HASHES, corrupt=[H2])

    assert counters.take()["corrupt_entries"] == 1
    assert index.count_held_prefix(0, HASHES) == 1
    assert index.take_events() == [BlockRemoved(block_hashes=(H2,), medium="cpu", group=0)]
    # Dropped as corrupt, not evicted to make room.
    assert index.take_counters() == {}
    # Its slot is free again: storing H2 anew evicts nothing.
    assert index.prepare_save(0, [H2]) == [(H2, slots[1])]
    assert index.take_counters() == {}


def test_the_pool_writes_no_payload_checksum_and_loads_its_own_payload_as_written(
    handlers: list[DrivenHandler[TransferHandler]],
) -> None:
    # Memory this process allocated and only kvwire writes: a checksum pass
    # would guard against nothing, so none is made (the header still is checked).
    pool = medium(4)
    index = pool.build_index()
    caches = layout_caches(LAYOUT, seed=4)
    handler = DrivenHandler(pool.build_handler(caches, Counters()))
    handlers.append(handler)
    slots = stored(index, handler)
    entry = pool_of(handler.handler).pool.entry(slots[0])
    assert entry[FLAGS_AT] == FLAG_NO_CHECKSUM
    assert bytes(entry[CHECKSUM_AT : CHECKSUM_AT + 8]) == bytes(8)

    assert load_into_2_and_3(index, handler) == set()
    for cache in caches.values():
        assert torch.equal(bits(cache, 2), bits(cache, 0))


def test_a_load_into_a_block_outside_the_cache_fails_that_block_alone(
    handlers: list[DrivenHandler[TransferHandler]],
) -> None:
    # The headers of a chunk are checked with one comparison; any block that
    # does not pass it is checked alone, and only that one fails.
    pool = medium(4)
    index = pool.build_index()
    caches = layout_caches(LAYOUT, seed=4)
    handler = DrivenHandler(pool.build_handler(caches, Counters()))
    handlers.append(handler)
    slots = stored(index, handler)
    outside = next(iter(caches.values())).shape[1]  # one past the last block

    handler.start_loads(
        [BlockTransfer(request_id="c", block_ids=(2, outside), block_hashes=HASHES, slots=slots)],
        [],
    )

    assert handler.take_load_errors() == {outside}
    for cache in caches.values():
        assert torch.equal(bits(cache, 2), bits(cache, 0))


def test_a_store_that_fails_half_way_leaves_slots_that_name_no_block(
    handlers: list[DrivenHandler[TransferHandler]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No payload checksum would notice a slot half rewritten under a header
    # still naming its block: the store clears the headers before it copies.
    pool = medium(4)
    index = pool.build_index()
    caches = layout_caches(LAYOUT, seed=4)
    handler = DrivenHandler(pool.build_handler(caches, Counters()))
    handlers.append(handler)
    slots = stored(index, handler)

    def fails_half_way(
        self: PagedKVCaches, block_ids: Any, slots: Any, entries: torch.Tensor
    ) -> None:
        entries[slots[0]].fill_(7.0)  # the first block copied, then a fault
        raise RuntimeError("copy failed half way")

    monkeypatch.setattr(PagedKVCaches, "gather_many", fails_half_way)
    handler.save(
        [BlockTransfer(request_id="again", block_ids=(0, 1), block_hashes=HASHES, slots=slots)]
    )
    assert handler.wait_for_saves(TEST_LIMIT_S)
    before = [bits(cache, 2).clone() for cache in caches.values()]
    handler.start_loads(
        [BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES, slots=slots)], []
    )

    assert handler.take_load_errors() == {2, 3}
    assert all(
        torch.equal(bits(cache, 2), old) for cache, old in zip(caches.values(), before, strict=True)
    )


def test_a_block_being_loaded_is_not_evicted_until_its_load_completes() -> None:
    index = medium(1).build_index()
    index.prepare_save(0, [H1])
    index.complete_save(0, [H1], success=True)

    assert index.prepare_load(0, [H1]).slots == (0,)
    assert index.prepare_save(0, [H2]) == []
    index.complete_load(0, [H1], corrupt=[])
    assert index.prepare_save(0, [H2]) == [(H2, 0)]


def test_reset_forgets_every_block_no_transfer_uses_and_reports_them_removed() -> None:
    index = medium(3).build_index()
    index.prepare_save(0, [H1, H2])
    index.complete_save(0, [H1, H2], success=True)
    index.take_events()
    index.prepare_load(0, [H2])

    assert index.reset() is False  # H2 is being loaded
    assert index.take_events() == [BlockRemoved(block_hashes=(H1,), medium="cpu", group=0)]
    index.complete_load(0, [H2], corrupt=[])
    assert index.reset() is True
    assert index.take_events() == [BlockRemoved(block_hashes=(H2,), medium="cpu", group=0)]
    assert index.count_held_prefix(0, [H1]) == 0
    assert index.take_counters() == {}  # forgotten on request, not evicted


# ------------------------------------------------- saves released or waited out


@pytest.fixture
def copies_go_on() -> Iterator[threading.Event]:
    """While clear, stores stall before their first copy (set at teardown)."""
    event = threading.Event()
    try:
        yield event
    finally:
        event.set()


def test_a_save_reading_a_block_given_away_is_released_and_copies_nothing(
    monkeypatch: pytest.MonkeyPatch,
    copies_go_on: threading.Event,
    handlers: list[DrivenHandler[TransferHandler]],
) -> None:
    chunks = cpu_pool_handler_module.cache_sized_chunks

    def stalled_chunks(count: int, entry_bytes: int) -> list[range]:
        copies_go_on.wait(TEST_LIMIT_S)
        return chunks(count, entry_bytes)

    monkeypatch.setattr(cpu_pool_handler_module, "cache_sized_chunks", stalled_chunks)
    pool = medium(4)
    counters = Counters()
    index = pool.build_index()
    handler = DrivenHandler(pool.build_handler(layout_caches(LAYOUT, seed=5), counters))
    handlers.append(handler)
    placed = index.prepare_save(0, HASHES)
    save = BlockTransfer(
        request_id="p",
        block_ids=(0, 1),
        block_hashes=HASHES,
        slots=tuple(slot for _, slot in placed if slot is not None),
    )
    handler.save([save])

    # Block 1 was freed and given to another request, which writes it this step.
    released = handler.release_saves_reading([], {1})

    assert released == [save]
    assert counters.take()["saves_released"] == 2
    copies_go_on.set()
    assert handler.wait_for_saves(TEST_LIMIT_S)
    assert not handler.is_busy("p")
    assert "blocks_saved" not in counters.take()
    # Nothing was copied: the slots, were they published, would be refused.
    index.complete_save(0, HASHES, success=True)
    assert load_into_2_and_3(index, handler) == {2, 3}
