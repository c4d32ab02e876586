"""Large entries of a directory store: verified in their mapped file, then copied once.

A store worker over a :class:`DirectoryBlockStore` reads entries of
``MIN_MAPPED_ENTRY_BYTES`` and more by mapping the file instead of reading
it into staging first; the integrity rules are the same as on the staging
path.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch

from kvwire.connectors.block_format import HEADER_SIZE, BlockLayout
from kvwire.connectors.file_store import DirectoryBlockStore
from kvwire.connectors.store_worker import (
    MIN_MAPPED_ENTRY_BYTES,
    MappingBlockStore,
)
from tests.connectors.store_workers import (
    HASHES,
    load_into_blocks_2_and_3,
    save_blocks_0_and_1,
)

# One entry: 2 layers x (keys, values) x 256 tokens x 8 heads x 128 x float32 = 4 MiB.
BLOCK_SIZE = 256
LAYOUT = BlockLayout(
    num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="float32"
)


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[DirectoryBlockStore]:
    directory_store = DirectoryBlockStore(tmp_path, entry_bytes=LAYOUT.entry_bytes)
    yield directory_store
    directory_store.close()


@pytest.fixture
def saved(store: DirectoryBlockStore) -> dict[str, torch.Tensor]:
    """Cache blocks 0 and 1 of a producer, saved under HASHES; the producer's caches."""
    return save_blocks_0_and_1(store, LAYOUT, seed=3)


def flip_payload_byte(store: DirectoryBlockStore, block_hash: bytes) -> None:
    path = pathlib.Path(store.path_of(LAYOUT.key(block_hash)))
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 1000] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_directory_store_maps_entries():
    store = DirectoryBlockStore("/nonexistent", entry_bytes=LAYOUT.entry_bytes)
    assert isinstance(store, MappingBlockStore)
    assert LAYOUT.entry_bytes >= MIN_MAPPED_ENTRY_BYTES


def test_large_entries_load_bit_exact(store: DirectoryBlockStore, saved: dict[str, torch.Tensor]):
    loaded, errors = load_into_blocks_2_and_3(store, LAYOUT)
    assert errors == set()
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, 2:4], cache[:, 0:2])


def test_a_flipped_byte_in_a_large_entry_is_reported_and_never_copied(
    store: DirectoryBlockStore, saved: dict[str, torch.Tensor]
):
    flip_payload_byte(store, HASHES[1])
    loaded, errors = load_into_blocks_2_and_3(store, LAYOUT)
    assert errors == {3}
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, 2], cache[:, 0])
        assert not loaded[name][:, 3].any()


def test_a_corrupt_large_entry_is_discarded(
    store: DirectoryBlockStore, saved: dict[str, torch.Tensor]
):
    flip_payload_byte(store, HASHES[0])
    load_into_blocks_2_and_3(store, LAYOUT)
    assert store.count_prefix([LAYOUT.key(HASHES[0])]) == 0
    assert store.count_prefix([LAYOUT.key(HASHES[1])]) == 1


def test_an_empty_entry_file_is_a_load_error(
    store: DirectoryBlockStore, saved: dict[str, torch.Tensor]
):
    pathlib.Path(store.path_of(LAYOUT.key(HASHES[0]))).write_bytes(b"")
    loaded, errors = load_into_blocks_2_and_3(store, LAYOUT)
    assert errors == {2}
    assert not any(cache[:, 2].any() for cache in loaded.values())


def test_a_missing_entry_is_a_load_error(
    store: DirectoryBlockStore, saved: dict[str, torch.Tensor]
):
    pathlib.Path(store.path_of(LAYOUT.key(HASHES[1]))).unlink()
    _, errors = load_into_blocks_2_and_3(store, LAYOUT)
    assert errors == {3}


def test_map_entry_answers_none_for_a_missing_or_empty_file(store: DirectoryBlockStore):
    key = LAYOUT.key(HASHES[0])
    assert store.map_entry(key) is None
    path = pathlib.Path(store.path_of(key))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert store.map_entry(key) is None


def test_map_entry_maps_the_bytes_put(store: DirectoryBlockStore):
    entry = memoryview(bytes(range(256)) * 8)
    assert store.put([LAYOUT.key(HASHES[0])], [entry]) == [True]
    mapping = store.map_entry(LAYOUT.key(HASHES[0]))
    assert mapping is not None
    try:
        assert mapping[:] == entry.tobytes()
    finally:
        mapping.close()
