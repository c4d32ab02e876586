"""The directory medium driven directly, with no connector: its index over the store, its handler.

A scheduler-side medium and a worker-side one are separate objects, as in
two processes, each building its own half over the same directory.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config.extra_config import ExtraConfigError, read_extra_config
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockRemoved, BlockStored
from kvwire.media.base import MediumContext
from kvwire.media.store._handler import StoreTransferHandler
from kvwire.media.store.base import CacheWrites
from kvwire.media.store.directory import DirectoryBlockStore, DirectoryMedium
from kvwire.media.store.directory import medium as directory
from tests.support.media import DrivenHandler
from tests.support.stores import layout_caches

CONNECTOR = "TestStoreConnector"
LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
NUM_BLOCKS = 8
ONE_GROUP = (CacheGroup(index=0, layer_names=("layers.0", "layers.1"), block_size=4),)
TWO_GROUPS = (
    CacheGroup(index=0, layer_names=("layers.0",), block_size=4),
    CacheGroup(index=1, layer_names=("layers.1",), block_size=4, sliding_window=9),
)
HASHES = tuple(bytes([i]) + bytes(range(31)) for i in range(1, 4))
MAC_VARIABLE = "KVWIRE_TEST_MEDIUM_MAC_KEY"


def context(
    extra: dict[str, Any],
    groups: tuple[CacheGroup, ...] = ONE_GROUP,
    layout: BlockLayout = LAYOUT,
    medium: type[DirectoryMedium] = DirectoryMedium,
) -> MediumContext:
    """The context a connector would build: the medium's keys read, then finished."""
    options = read_extra_config(CONNECTOR, extra, medium.extra_config_keys())
    return MediumContext(
        connector_name=CONNECTOR,
        options=medium.finish_options(CONNECTOR, options),
        groups=groups,
        layout=layout,
    )


@pytest.fixture
def storage_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "kv-store"


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Halves to close at the end of the test (index or handler)."""
    halves: list[Any] = []
    yield halves
    for half in reversed(halves):
        half.close()


def handler_over(
    medium: DirectoryMedium, caches: dict[str, torch.Tensor], closing: list[Any]
) -> DrivenHandler[StoreTransferHandler]:
    handler = DrivenHandler(medium.build_handler(caches, Counters()))
    closing.append(handler)
    return handler


def save(
    handler: DrivenHandler[StoreTransferHandler],
    block_ids: tuple[int, ...],
    hashes: tuple[bytes, ...],
) -> None:
    handler.save([BlockTransfer(request_id="p", block_ids=block_ids, block_hashes=hashes)])
    assert handler.wait_for_saves(30)


def block(caches: dict[str, torch.Tensor], block_id: int) -> list[torch.Tensor]:
    """Every layer's K and V of one block."""
    return [caches[name][:, block_id] for name in sorted(caches)]


def test_the_index_counts_the_prefix_the_handler_saved(storage_dir, closing):
    extra = {"shared_storage_path": str(storage_dir)}
    producer = handler_over(
        DirectoryMedium(context(extra)), layout_caches(LAYOUT, 1, NUM_BLOCKS), closing
    )
    save(producer, (1, 2), HASHES[:2])
    index = DirectoryMedium(context(extra)).build_index()
    closing.append(index)
    assert index.count_held_prefix(0, HASHES) == 2
    # Only a consecutive prefix counts: a missing first block hides the rest.
    assert index.count_held_prefix(0, (HASHES[2], *HASHES[:2])) == 0


def test_bytes_round_trip_bit_exact_through_a_save_and_a_load(storage_dir, closing):
    extra = {"shared_storage_path": str(storage_dir)}
    produced = layout_caches(LAYOUT, 7, NUM_BLOCKS)
    producer = handler_over(DirectoryMedium(context(extra)), produced, closing)
    save(producer, (1, 2, 3), HASHES)
    assert producer.take_events() == [BlockStored(HASHES, "disk", 0)]
    loaded = layout_caches(LAYOUT, None, NUM_BLOCKS)
    consumer = handler_over(DirectoryMedium(context(extra)), loaded, closing)
    consumer.start_loads(
        [BlockTransfer(request_id="c", block_ids=(5, 6, 7), block_hashes=HASHES)], []
    )
    consumer.wait_for_loads()
    assert consumer.take_load_errors() == set()
    for produced_id, loaded_id in [(1, 5), (2, 6), (3, 7)]:
        for want, got in zip(block(produced, produced_id), block(loaded, loaded_id), strict=True):
            assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    assert not any(block(loaded, 1)[0].flatten().tolist())  # nothing landed elsewhere


def test_a_path_that_cannot_be_created_names_the_key(tmp_path: pathlib.Path):
    (tmp_path / "a-file").write_bytes(b"")
    medium = DirectoryMedium(context({"shared_storage_path": str(tmp_path / "a-file" / "d")}))
    with pytest.raises(
        ExtraConfigError, match=r"kv_connector_extra_config\.shared_storage_path: cannot create"
    ):
        medium.build_index()


def test_a_path_with_a_nul_byte_is_refused_naming_the_key():
    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.shared_storage_path"):
        context({"shared_storage_path": "/tmp/kv\0store"})


def test_a_mac_key_names_entries_apart_from_plain_ones(
    storage_dir, closing, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(MAC_VARIABLE, "k" * 32)
    plain = DirectoryMedium(context({"shared_storage_path": str(storage_dir)}))
    sealed = DirectoryMedium(
        context({"shared_storage_path": str(storage_dir), "mac_key_env": MAC_VARIABLE})
    )
    assert plain.group_layouts[0].mac is None
    assert sealed.group_layouts[0].mac is not None
    assert sealed.layout.mac is not None
    assert sealed.group_layouts[0].fingerprint_hex != plain.group_layouts[0].fingerprint_hex
    assert sealed.store_key(HASHES[0]) != plain.store_key(HASHES[0])
    # A sealed producer's entries are no hits for a plain engine, nor the reverse.
    save(handler_over(sealed, layout_caches(LAYOUT, 3, NUM_BLOCKS), closing), (1,), HASHES[:1])
    plain_index, sealed_index = plain.build_index(), sealed.build_index()
    closing.extend([plain_index, sealed_index])
    assert (
        plain_index.count_held_prefix(0, HASHES),
        sealed_index.count_held_prefix(0, HASHES),
    ) == (
        0,
        1,
    )


def test_a_mac_key_variable_that_is_not_set_names_the_key(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(MAC_VARIABLE, raising=False)
    with pytest.raises(
        ExtraConfigError, match=rf"kv_connector_extra_config\.mac_key_env: .*{MAC_VARIABLE}"
    ):
        context({"shared_storage_path": "/tmp/kv", "mac_key_env": MAC_VARIABLE})


class _OneGroupKeys(DirectoryMedium):
    """A medium whose ``store_key`` predates KV cache groups: it takes no ``group``."""

    def store_key(self, block_hash: bytes) -> str:  # type: ignore[override]
        return self.group_layouts[0].key(block_hash[::-1])


def test_a_store_key_without_group_is_refused_on_a_hybrid_context(storage_dir):
    extra = {"shared_storage_path": str(storage_dir)}
    hybrid = context(extra, TWO_GROUPS, medium=_OneGroupKeys)
    with pytest.raises(TypeError, match=r"_OneGroupKeys\.store_key takes only a block hash.*2 KV"):
        _OneGroupKeys(hybrid)


def test_a_store_key_without_group_names_the_entries_of_a_single_group(storage_dir, closing):
    medium = _OneGroupKeys(context({"shared_storage_path": str(storage_dir)}))
    save(handler_over(medium, layout_caches(LAYOUT, 5, NUM_BLOCKS), closing), (1,), HASHES[:1])
    assert os.path.exists(medium.store.path_of(medium.store_key(HASHES[0])))
    assert not os.path.exists(medium.store.path_of(LAYOUT.key(HASHES[0])))


def test_a_hybrid_medium_keys_each_group_apart(storage_dir, closing):
    hybrid = DirectoryMedium(context({"shared_storage_path": str(storage_dir)}, TWO_GROUPS))
    keys = {hybrid.store_key(HASHES[0], group) for group in (0, 1)}
    assert len(keys) == 2
    assert {hybrid.block_hash_of(key) for key in keys} == {HASHES[0]}


def test_reset_removes_only_this_layouts_entries(storage_dir, closing):
    extra = {"shared_storage_path": str(storage_dir)}
    other_layout = BlockLayout(
        num_layers=2, block_size=4, num_kv_heads=2, head_size=16, dtype="float32"
    )
    mine = DirectoryMedium(context(extra))
    other = DirectoryMedium(context(extra, layout=other_layout))
    save(handler_over(mine, layout_caches(LAYOUT, 1, NUM_BLOCKS), closing), (1, 2), HASHES[:2])
    save(
        handler_over(other, layout_caches(other_layout, 2, NUM_BLOCKS), closing),
        (1, 2),
        HASHES[:2],
    )
    index = DirectoryMedium(context(extra)).build_index()
    other_index = DirectoryMedium(context(extra, layout=other_layout)).build_index()
    closing.extend([index, other_index])
    assert index.reset() is True
    assert index.count_held_prefix(0, HASHES) == 0
    assert other_index.count_held_prefix(0, HASHES) == 2


class _HeldWrites(DirectoryBlockStore):
    """Writes wait for ``go``; ``writing`` is set once one waits."""

    def __init__(self, root: str, *, entry_bytes: int) -> None:
        super().__init__(root, entry_bytes=entry_bytes)
        self.go = threading.Event()
        self.writing = threading.Event()

    def write_ranges(
        self, keys: Any, ranges_per_key: Any, commit_gate: CacheWrites | None = None
    ) -> list[bool]:
        self.writing.set()
        assert self.go.wait(30)
        return super().write_ranges(keys, ranges_per_key, commit_gate)


class _HeldMedium(DirectoryMedium):
    def create_store(self, options: Any) -> DirectoryBlockStore:
        checked = super().create_store(options)
        return _HeldWrites(checked.root, entry_bytes=self.layout.entry_bytes)


def test_releasing_a_running_save_returns_it_and_stores_nothing_of_it(storage_dir, closing):
    extra = {"shared_storage_path": str(storage_dir)}
    medium = _HeldMedium(context(extra, medium=_HeldMedium))
    store = medium.store
    assert isinstance(store, _HeldWrites)
    handler = handler_over(medium, layout_caches(LAYOUT, 1, NUM_BLOCKS), closing)
    handler.save([BlockTransfer(request_id="p", block_ids=(1, 2), block_hashes=HASHES[:2])])
    assert store.writing.wait(30)
    assert handler.is_busy("p")
    assert handler.release_saves_reading((), {2, 5}) == [
        BlockTransfer(request_id="p", block_ids=(1, 2), block_hashes=HASHES[:2])
    ]
    assert not handler.is_busy("p")
    assert handler.release_saves_reading(["p"], set()) == []  # nothing of it runs any more
    store.go.set()
    assert handler.wait_for_saves(30)
    index = DirectoryMedium(context(extra)).build_index()
    closing.append(index)
    assert index.count_held_prefix(0, HASHES) == 0


def test_the_worker_sweeps_stale_temporary_files_and_counts_them(storage_dir, closing):
    medium = DirectoryMedium(context({"shared_storage_path": str(storage_dir)}))
    shard = storage_dir / medium.layout.fingerprint_hex / "ab"
    shard.mkdir(parents=True)
    stale = shard / ".ab12.4242.1.tmp"
    stale.write_bytes(b"half an entry")
    os.utime(stale, (0, 0))
    handler = medium.build_handler(layout_caches(LAYOUT, None, NUM_BLOCKS), Counters())
    handler.close()  # joins the sweep
    assert not stale.exists()
    assert handler.take_counters()["stale_temporary_files_removed"] == 1


@pytest.mark.timeout(20)
def test_close_waits_for_a_stuck_sweep_only_so_long(
    storage_dir, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    stuck = threading.Event()

    def sweep_on_a_hung_filesystem(store: DirectoryBlockStore) -> int:
        stuck.wait(30)
        return 0

    monkeypatch.setattr(
        DirectoryBlockStore, "sweep_stale_temporary_files", sweep_on_a_hung_filesystem
    )
    monkeypatch.setattr(directory, "SWEEP_JOIN_S", 0.05)
    medium = DirectoryMedium(context({"shared_storage_path": str(storage_dir)}))
    handler = medium.build_handler(layout_caches(LAYOUT, None, NUM_BLOCKS), Counters())
    try:
        with caplog.at_level(logging.WARNING):
            handler.close()
        assert "shutting down without waiting for it" in caplog.text
    finally:
        stuck.set()


class _CountedCloses(DirectoryBlockStore):
    def __init__(self, root: str, *, entry_bytes: int) -> None:
        super().__init__(root, entry_bytes=entry_bytes)
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        super().close()


class _CountedMedium(DirectoryMedium):
    def create_store(self, options: Any) -> DirectoryBlockStore:
        checked = super().create_store(options)
        return _CountedCloses(checked.root, entry_bytes=self.layout.entry_bytes)


def test_the_store_is_created_once_and_closed_by_the_last_half_to_close(storage_dir):
    medium = _CountedMedium(
        context({"shared_storage_path": str(storage_dir)}, medium=_CountedMedium)
    )
    index = medium.build_index()
    handler = medium.build_handler(layout_caches(LAYOUT, None, NUM_BLOCKS), Counters())
    store = medium.store
    assert isinstance(store, _CountedCloses)
    index.close()
    assert store.closes == 0  # the handler still uses it
    handler.close()
    assert store.closes == 1
    assert medium.store is store


ONE_LAYER = BlockLayout(num_layers=1, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")


def test_events_name_the_kv_cache_group_of_their_blocks(storage_dir, closing):
    # On a hybrid model one block hash names an entry per group: a router
    # must know which group's entry was stored, or found corrupt and removed.
    hybrid = DirectoryMedium(
        context({"shared_storage_path": str(storage_dir)}, TWO_GROUPS, layout=ONE_LAYER)
    )
    caches = layout_caches(LAYOUT, 3, NUM_BLOCKS)  # layers.0 (group 0), layers.1 (group 1)
    handler = handler_over(hybrid, caches, closing)
    handler.save(
        [
            BlockTransfer(request_id="p", block_ids=(1,), block_hashes=HASHES[:1], group=0),
            BlockTransfer(request_id="p", block_ids=(2, 3), block_hashes=HASHES[1:], group=1),
        ]
    )
    assert handler.wait_for_saves(30)
    assert sorted(handler.take_events(), key=lambda event: event.group or 0) == [
        BlockStored(HASHES[:1], "disk", 0),
        BlockStored(HASHES[1:], "disk", 1),
    ]
    assert [hybrid.block_group_of(hybrid.store_key(HASHES[0], g)) for g in (0, 1)] == [0, 1]

    # A corrupt group-1 entry found by a load is removed, and the event says so.
    path = hybrid.store.path_of(hybrid.store_key(HASHES[2], 1))
    with open(path, "r+b") as entry:
        entry.seek(-1, os.SEEK_END)
        last = entry.read(1)
        entry.seek(-1, os.SEEK_END)
        entry.write(bytes([last[0] ^ 0xFF]))
    handler.start_loads(
        [BlockTransfer(request_id="q", block_ids=(5,), block_hashes=HASHES[2:], group=1)], []
    )
    handler.wait_for_loads()
    assert handler.take_load_errors() == {5}
    assert handler.take_events() == [BlockRemoved(HASHES[2:], "disk", 1)]
