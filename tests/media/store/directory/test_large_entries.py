"""Large entries of a directory store, read straight into the cache over several calls.

An entry of several MiB is read with more than one ``preadv`` (each moves at
most :data:`MAX_IO_BYTES`) into the header buffer and the block's ranges,
then verified there: a block counts loaded only once its whole entry checks.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch

from kvwire.blocks.format import HEADER_SIZE, BlockLayout
from kvwire.media.store.directory.block_store import MAX_IO_BYTES, DirectoryBlockStore
from tests.support.stores import (
    HASHES,
    load_into_blocks_2_and_3,
    save_blocks_0_and_1,
)

# One entry: 2 layers x (keys, values) x 512 tokens x 8 heads x 128 x float32 = 8 MiB.
BLOCK_SIZE = 512
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


def test_an_entry_takes_several_reads():
    assert LAYOUT.entry_bytes > 2 * MAX_IO_BYTES


def test_large_entries_load_bit_exact(store: DirectoryBlockStore, saved: dict[str, torch.Tensor]):
    loaded, errors = load_into_blocks_2_and_3(store, LAYOUT)
    assert errors == set()
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, 2:4], cache[:, 0:2])


def test_a_flipped_byte_in_a_large_entry_is_a_load_error_of_its_block_only(
    store: DirectoryBlockStore, saved: dict[str, torch.Tensor]
):
    flip_payload_byte(store, HASHES[1])
    loaded, errors = load_into_blocks_2_and_3(store, LAYOUT)
    # Block 3 holds the damaged bytes, and is reported: the engine computes it again.
    assert errors == {3}
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, 2], cache[:, 0])


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
    _, errors = load_into_blocks_2_and_3(store, LAYOUT)
    assert errors == {2}


def test_a_missing_entry_is_a_load_error(
    store: DirectoryBlockStore, saved: dict[str, torch.Tensor]
):
    pathlib.Path(store.path_of(LAYOUT.key(HASHES[1]))).unlink()
    _, errors = load_into_blocks_2_and_3(store, LAYOUT)
    assert errors == {3}
