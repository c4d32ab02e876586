"""What a directory store does with a file in an entry's place that is not a whole entry.

A FIFO, a link or a file longer than an entry is a bad entry: warned about
and counted like a corrupt one, a load error (the engine recomputes the
block), never a hang and never more than an entry's bytes read. An oversized
regular file is discarded; a link is left alone (its target is not kvwire's)
and is no hit for later lookups.
"""

from __future__ import annotations

import logging
import os
import pathlib
import struct

import pytest

from kvwire.blocks.format import FLAG_NO_CHECKSUM, HEADER_SIZE, BlockLayout
from kvwire.interface.types import KVCacheBlocks, SchedulerOutput
from kvwire.media.store.directory.block_store import DirectoryBlockStore
from tests.support.pairs import PairFactory, make_request
from tests.support.stores import (
    HASHES,
    load_into_blocks_2_and_3,
    save_blocks_0_and_1,
)

BLOCK = 4
PROMPT = list(range(100, 117))  # 4 full blocks
PRODUCER_BLOCKS = [3, 7, 1, 9, 12]
CONSUMER_BLOCKS = [20, 21, 22, 23, 24]
# Entries of 4 MiB: read with more than one call.
# Where an entry's header holds its payload checksum (its flags follow).
CHECKSUM_AT = struct.calcsize("<4sHH16s32s5IQ")
LARGE = BlockLayout(num_layers=2, block_size=256, num_kv_heads=8, head_size=128, dtype="float32")


def entry_of_block(storage_dir: pathlib.Path, index: int) -> pathlib.Path:
    """The file of the prompt's block ``index``, once a producer saved it."""
    name = make_request("c", PROMPT, BLOCK).block_hashes[index].hex()
    (path,) = storage_dir.glob(f"*/{name[:2]}/{name}")
    return path


def produce(build: PairFactory) -> None:
    producer = build(seed=1)
    producer.prefill(make_request("p", PROMPT, BLOCK), PRODUCER_BLOCKS)
    assert producer.worker.wait_for_pending_saves(30)  # type: ignore[attr-defined]


def load_after_lookup(build: PairFactory, replace: pathlib.Path, with_what) -> object:
    """A consumer that looks the prompt up, then loads it after ``replace`` was changed."""
    consumer = build()
    request = make_request("c", PROMPT, BLOCK)
    matched, _ = consumer.lookup(request)
    assert matched == 4 * BLOCK
    replace.unlink()
    with_what(replace)
    consumer.scheduler.update_state_after_alloc(request, KVCacheBlocks((CONSUMER_BLOCKS,)), matched)
    consumer.step(SchedulerOutput())
    return consumer


@pytest.mark.timeout(20)
def test_a_fifo_put_in_an_entrys_place_is_a_load_error_not_a_hang(
    shared_storage_pair: PairFactory, storage_dir: pathlib.Path, caplog
):
    produce(shared_storage_pair)
    victim = entry_of_block(storage_dir, 1)
    with caplog.at_level(logging.WARNING):
        consumer = load_after_lookup(shared_storage_pair, victim, os.mkfifo)
    assert consumer.load_errors == {CONSUMER_BLOCKS[1]}
    assert "is not a regular file" in caplog.text
    assert consumer.stats["corrupt_entries"] == 1


def test_a_fifo_is_no_hit(tmp_path: pathlib.Path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=LARGE.entry_bytes)
    path = pathlib.Path(store.path_of(LARGE.key(HASHES[0])))
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    assert store.count_prefix([LARGE.key(HASHES[0])]) == 0


def test_trailing_bytes_make_a_warned_load_error_and_the_entry_is_discarded(
    shared_storage_pair: PairFactory, storage_dir: pathlib.Path, caplog
):
    produce(shared_storage_pair)
    victim = entry_of_block(storage_dir, 2)
    with victim.open("ab") as entry:
        entry.write(b"trailing")
    consumer = shared_storage_pair()
    with caplog.at_level(logging.WARNING):
        consumer.prefill(make_request("c", PROMPT, BLOCK), CONSUMER_BLOCKS)
    assert consumer.load_errors == {CONSUMER_BLOCKS[2]}
    assert "longer than an entry" in caplog.text
    assert consumer.stats["corrupt_entries"] == 1
    assert not victim.exists()
    assert consumer.lookup(make_request("d", PROMPT, BLOCK)) == (2 * BLOCK, False)


def test_trailing_bytes_after_a_large_entry_make_a_load_error_reading_nothing(
    tmp_path: pathlib.Path, caplog
):
    store = DirectoryBlockStore(tmp_path, entry_bytes=LARGE.entry_bytes)
    save_blocks_0_and_1(store, LARGE, seed=3)
    victim = pathlib.Path(store.path_of(LARGE.key(HASHES[0])))
    with victim.open("ab") as entry:
        entry.write(b"trailing")
    with caplog.at_level(logging.WARNING):
        loaded, errors = load_into_blocks_2_and_3(store, LARGE)
    assert errors == {2}
    assert not any(cache[:, 2].any() for cache in loaded.values())
    assert "longer than an entry" in caplog.text
    assert not victim.exists()


def test_a_link_to_a_huge_file_is_never_read_nor_its_target_removed(tmp_path: pathlib.Path, caplog):
    root = tmp_path / "store"
    root.mkdir()
    store = DirectoryBlockStore(root, entry_bytes=LARGE.entry_bytes)
    save_blocks_0_and_1(store, LARGE, seed=3)
    huge = tmp_path / "huge"
    with huge.open("wb") as target:
        target.truncate(4 * 1024**3)  # sparse: 4 GiB that take no disk
    link = pathlib.Path(store.path_of(LARGE.key(HASHES[1])))
    link.unlink()
    link.symlink_to(huge)
    with caplog.at_level(logging.WARNING):
        _, errors = load_into_blocks_2_and_3(store, LARGE)
    assert errors == {3}
    assert "is a symbolic link" in caplog.text
    assert link.is_symlink() and huge.stat().st_size == 4 * 1024**3


def test_a_link_in_an_entrys_place_is_no_hit(tmp_path: pathlib.Path):
    (tmp_path / "store").mkdir()
    store = DirectoryBlockStore(tmp_path / "store", entry_bytes=LARGE.entry_bytes)
    save_blocks_0_and_1(store, LARGE, seed=3)
    link = pathlib.Path(store.path_of(LARGE.key(HASHES[1])))
    link.rename(tmp_path / "moved")
    link.symlink_to(tmp_path / "moved")
    assert store.count_prefix([LARGE.key(h) for h in HASHES]) == 1


def test_a_read_only_reader_under_a_size_cap_still_loads(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    store = DirectoryBlockStore(tmp_path, entry_bytes=LARGE.entry_bytes, max_bytes=2**40)
    saved = save_blocks_0_and_1(store, LARGE, seed=3)

    def read_only_filesystem(*args: object, **kwargs: object) -> None:
        raise OSError(30, "Read-only file system")

    # The mtime refresh that keeps eviction least-recently-used is best effort.
    monkeypatch.setattr(os, "utime", read_only_filesystem)
    loaded, errors = load_into_blocks_2_and_3(store, LARGE)
    assert errors == set()
    for name, cache in saved.items():
        assert (loaded[name][:, 2:4] == cache[:, 0:2]).all()


def test_an_entry_without_a_payload_checksum_is_refused_as_corrupt(
    shared_storage_pair: PairFactory, storage_dir: pathlib.Path
):
    # Only a pool in the writer's own process may skip the payload checksum:
    # such an entry on disk, whatever its payload holds, is never loaded.
    produce(shared_storage_pair)
    victim = entry_of_block(storage_dir, 1)
    unchecked = bytearray(victim.read_bytes())
    struct.pack_into("<QI", unchecked, CHECKSUM_AT, 0, FLAG_NO_CHECKSUM)
    unchecked[HEADER_SIZE] ^= 0x01  # other KV than the block's

    consumer = load_after_lookup(
        shared_storage_pair, victim, lambda path: path.write_bytes(bytes(unchecked))
    )

    assert consumer.load_errors == {CONSUMER_BLOCKS[1]}
    assert consumer.stats["corrupt_entries"] == 1
