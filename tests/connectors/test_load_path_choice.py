"""Which way a directory store's entries reach the cache: mapped, or read into staging.

Entries of :data:`MIN_MAPPED_ENTRY_BYTES` and more are verified in their
mapped file and copied once; smaller ones are read into staging first, which
costs less than mapping them. Both ways load the same bytes and keep the same
integrity rule: a corrupt entry never reaches the cache.
"""

from __future__ import annotations

import mmap
import pathlib

import torch

from kvwire.connectors.block_format import BlockLayout
from kvwire.connectors.file_store import DirectoryBlockStore
from kvwire.connectors.store_worker import MIN_MAPPED_ENTRY_BYTES
from tests.connectors.store_workers import (
    HASHES,
    load_into_blocks_2_and_3,
    save_blocks_0_and_1,
)

# 2 layers x (keys, values) x 8 heads x 128 x float32 = 16 KiB a token: 512 KiB and 4 MiB.
SMALL = BlockLayout(num_layers=2, block_size=32, num_kv_heads=8, head_size=128, dtype="float32")
LARGE = BlockLayout(num_layers=2, block_size=256, num_kv_heads=8, head_size=128, dtype="float32")


class RecordingStore(DirectoryBlockStore):
    """A real directory store that also notes which keys it was asked to map."""

    def __init__(self, root: pathlib.Path) -> None:
        super().__init__(root, entry_bytes=LARGE.entry_bytes)
        self.mapped_keys: list[str] = []

    def map_entry(self, key: str) -> mmap.mmap | None:
        self.mapped_keys.append(key)
        return super().map_entry(key)


def test_the_two_layouts_fall_on_either_side_of_the_mapping_threshold():
    assert SMALL.entry_bytes < MIN_MAPPED_ENTRY_BYTES <= LARGE.entry_bytes


def test_entries_below_the_threshold_are_read_through_staging_bit_exact(tmp_path: pathlib.Path):
    store = RecordingStore(tmp_path)
    saved = save_blocks_0_and_1(store, SMALL, seed=5)
    loaded, errors = load_into_blocks_2_and_3(store, SMALL)
    assert errors == set()
    assert store.mapped_keys == []
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, 2:4], cache[:, 0:2])


def test_entries_from_the_threshold_on_are_mapped_bit_exact(tmp_path: pathlib.Path):
    store = RecordingStore(tmp_path)
    saved = save_blocks_0_and_1(store, LARGE, seed=5)
    loaded, errors = load_into_blocks_2_and_3(store, LARGE)
    assert errors == set()
    assert store.mapped_keys == [LARGE.key(h) for h in HASHES]
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, 2:4], cache[:, 0:2])


def test_a_flipped_byte_in_a_mapped_entry_is_reported_and_never_copied(tmp_path: pathlib.Path):
    store = RecordingStore(tmp_path)
    saved = save_blocks_0_and_1(store, LARGE, seed=5)
    path = pathlib.Path(store.path_of(LARGE.key(HASHES[1])))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the entry's last byte: checked before its first reaches the cache
    path.write_bytes(bytes(data))
    loaded, errors = load_into_blocks_2_and_3(store, LARGE)
    assert errors == {3}
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, 2], cache[:, 0])
        assert not loaded[name][:, 3].any()
