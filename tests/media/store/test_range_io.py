"""Entries moved as byte ranges: the header and checks equal the joined entry's, stores round-trip.

A directory store reads and writes ranges with ``preadv``/``pwritev``; any
other store gets the base class's defaults, through a scratch buffer. A load
given up on (its :class:`CacheWrites` closed) writes nothing more into the ranges.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence

import pytest

from kvwire.blocks.format import (
    HEADER_SIZE,
    BlockLayout,
    CorruptBlockError,
    encode_header,
    verify_entry,
    verify_parts,
    write_header,
)
from kvwire.blocks.mac import EntryMac
from kvwire.exceptions import JobAbandoned
from kvwire.media.store.base import BlockStore, CacheWrites, LateWriteError
from kvwire.media.store.directory.block_store import MAX_IO_BYTES, DirectoryBlockStore, _io_batches

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
SEALED = BlockLayout(
    num_layers=2,
    block_size=4,
    num_kv_heads=2,
    head_size=8,
    dtype="float32",
    mac=EntryMac(b"k" * 32, "KVWIRE_TEST_KEY"),
)
HASH = bytes(range(32))


def split(payload: bytes, cuts: Sequence[int]) -> list[memoryview]:
    """``payload`` as writable ranges cut at ``cuts``."""
    edges = [0, *cuts, len(payload)]
    return [memoryview(bytearray(payload[a:b])) for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("layout", [LAYOUT, SEALED], ids=["checksum", "mac"])
def test_a_header_encoded_over_ranges_is_the_joined_entrys_and_verifies_over_them(layout):
    payload = os.urandom(layout.payload_bytes)
    joined = memoryview(bytearray(HEADER_SIZE) + payload)
    write_header(joined, layout, HASH)
    parts = split(payload, [64, 65, 300])
    header = memoryview(bytearray(HEADER_SIZE))
    encode_header(header, parts, layout, HASH)
    assert bytes(header) == bytes(joined[:HEADER_SIZE])
    verify_parts(header, parts, layout.entry_bytes, layout, HASH)
    verify_entry(joined, layout, HASH)


@pytest.mark.parametrize("layout", [LAYOUT, SEALED], ids=["checksum", "mac"])
def test_a_flipped_bit_in_any_range_fails_verification(layout):
    payload = os.urandom(layout.payload_bytes)
    parts = split(payload, [64, 300])
    header = memoryview(bytearray(HEADER_SIZE))
    encode_header(header, parts, layout, HASH)
    parts[1][5] ^= 0x10
    with pytest.raises(CorruptBlockError, match="payload checksum mismatch"):
        verify_parts(header, parts, layout.entry_bytes, layout, HASH)


def test_an_entry_read_short_is_refused_whatever_its_ranges_hold():
    payload = os.urandom(LAYOUT.payload_bytes)
    parts = split(payload, [100])
    header = memoryview(bytearray(HEADER_SIZE))
    encode_header(header, parts, LAYOUT, HASH)
    with pytest.raises(CorruptBlockError, match="payload is"):
        verify_parts(header, parts, LAYOUT.entry_bytes - 1, LAYOUT, HASH)


class DictStore(BlockStore):
    """A store with only the abstract methods: range I/O goes through the defaults."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}

    def count_prefix(self, keys: Sequence[str]) -> int:
        return 0

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        for key, entry in zip(keys, entries, strict=True):
            self.entries[key] = bytes(entry)
        return [True] * len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sizes: list[int | None] = []
        for key, buffer in zip(keys, buffers, strict=True):
            entry = self.entries.get(key)
            if entry is None or len(entry) > len(buffer):
                sizes.append(None)
                continue
            buffer[: len(entry)] = entry
            sizes.append(len(entry))
        return sizes


def stores(tmp_path) -> dict[str, BlockStore]:
    big = 3 * MAX_IO_BYTES
    return {
        "defaults": DictStore(),
        "directory": DirectoryBlockStore(tmp_path, entry_bytes=big),
    }


@pytest.mark.parametrize("kind", ["defaults", "directory"])
def test_entries_written_from_ranges_read_back_into_ranges_byte_for_byte(tmp_path, kind):
    store = stores(tmp_path)[kind]
    # Sizes around the per-call limit: a range longer than one call is split.
    sizes = [300, MAX_IO_BYTES + 7, 2 * MAX_IO_BYTES + 3]
    keys = [f"{'ab' * 16}/{i:064x}" for i in range(len(sizes))]
    entries = [os.urandom(size) for size in sizes]
    written = [split(entry, [1, len(entry) // 2]) for entry in entries]
    assert store.write_ranges(keys, written) == [True, True, True]
    targets = [split(bytes(size), [10, size - 5]) for size in sizes]
    landed = list(store.read_into_ranges(keys, targets))
    assert landed == [(i, size) for i, size in enumerate(sizes)]
    for entry, ranges in zip(entries, targets, strict=True):
        assert b"".join(bytes(part) for part in ranges) == entry


@pytest.mark.parametrize("kind", ["defaults", "directory"])
def test_an_entry_longer_than_its_ranges_is_a_failure_that_writes_nothing(tmp_path, kind):
    store = stores(tmp_path)[kind]
    key = f"{'ab' * 16}/{1:064x}"
    store.write_ranges([key], [split(os.urandom(100), [])])
    target = split(bytes(99), [50])
    assert list(store.read_into_ranges([key], [target])) == [(0, None)]
    assert all(not any(part) for part in target)


@pytest.mark.parametrize("kind", ["defaults", "directory"])
def test_a_load_given_up_on_writes_nothing_into_its_ranges(tmp_path, kind):
    store = stores(tmp_path)[kind]
    keys = [f"{'ab' * 16}/{i:064x}" for i in range(2)]
    store.write_ranges(keys, [split(os.urandom(64), []) for _ in keys])
    writes = CacheWrites()
    targets = [split(bytes(64), [32]) for _ in keys]
    landed = store.read_into_ranges(keys, targets, writes)
    assert next(landed) == (0, 64)
    writes.close(grace_s=0)
    with pytest.raises(JobAbandoned):
        next(landed)
    assert not any(bytes(part).strip(b"\0") for part in targets[1])


def test_a_waiter_that_gives_up_waits_for_the_write_under_way_then_says_so():
    writes = CacheWrites()
    entered, release = threading.Event(), threading.Event()

    def stuck_write() -> None:
        with writes.writing():
            entered.set()
            release.wait()

    writer = threading.Thread(target=stuck_write)
    writer.start()
    entered.wait()
    with pytest.raises(LateWriteError, match="still writing into the KV cache"):
        writes.close(grace_s=0.01)
    release.set()
    writer.join()
    with pytest.raises(JobAbandoned), writes.writing():
        pass


def test_a_write_that_moves_nothing_fails_the_entry_and_leaves_no_file(tmp_path, monkeypatch):
    # A pwritev that returns 0 without an error must not be retried for ever.
    calls = []

    def moves_nothing(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(5, "the test stopped a write that was retried")
        return 0

    monkeypatch.setattr(os, "pwritev", moves_nothing)
    store = DirectoryBlockStore(tmp_path, entry_bytes=64)
    key = f"{'ab' * 16}/{1:064x}"
    assert store.write_ranges([key], [split(os.urandom(64), [])]) == [False]
    assert len(calls) == 1
    assert store.take_counters() == {"write_io_errors": 1}
    assert [files for _, _, files in os.walk(tmp_path) if files] == []


def test_io_batches_pass_whole_ranges_through_and_cut_only_at_the_limits():
    # A block's hundreds of ranges go into a call as they are: no slice each.
    ranges = [memoryview(bytearray(100)) for _ in range(2000)]
    batches = _io_batches(ranges, 100 * 2000)
    assert [len(batch) for batch in batches] == [1024, 976]
    assert all(a is b for a, b in zip(itertools.chain(*batches), ranges, strict=True))
    # Cut where a range crosses a call's byte limit, and at the end of the size asked.
    big = [memoryview(bytearray(MAX_IO_BYTES - 10)), memoryview(bytearray(30))]
    assert [[len(p) for p in batch] for batch in _io_batches(big, MAX_IO_BYTES + 15)] == [
        [MAX_IO_BYTES - 10, 10],
        [15],
    ]
    assert _io_batches(big, 5)[0][0].nbytes == 5


@pytest.mark.parametrize("kind", ["defaults", "directory"])
def test_a_save_whose_gate_is_closed_commits_nothing_and_leaves_the_entry_there(tmp_path, kind):
    store = stores(tmp_path)[kind]
    key = f"{'ab' * 16}/{1:064x}"
    good = os.urandom(64)
    assert store.write_ranges([key], [split(good, [])]) == [True]
    closed = CacheWrites()
    closed.close(grace_s=0)

    assert store.write_ranges([key], [split(os.urandom(64), [32])], closed) == [False]

    target = split(bytes(64), [])
    assert list(store.read_into_ranges([key], [target])) == [(0, 64)]
    assert bytes(target[0]) == good
    if kind == "directory":
        assert [name for _, _, files in os.walk(tmp_path) for name in files] == [key[33:]]


class _ClosesAtCommit(CacheWrites):
    """Open until a store asks, once all of an entry's bytes are written, whether it may commit."""

    def is_open(self) -> bool:
        self.close(grace_s=0)
        return super().is_open()


def test_the_directory_store_removes_a_file_whose_gate_closed_while_it_was_written(tmp_path):
    store = DirectoryBlockStore(tmp_path, entry_bytes=64)
    key = f"{'ab' * 16}/{1:064x}"
    good = os.urandom(64)
    assert store.write_ranges([key], [split(good, [])]) == [True]

    assert store.write_ranges([key], [split(os.urandom(64), [32])], _ClosesAtCommit()) == [False]

    with open(store.path_of(key), "rb") as entry:
        assert entry.read() == good
    assert [name for _, _, files in os.walk(tmp_path) for name in files] == [key[33:]]
    assert store.take_counters() == {}
