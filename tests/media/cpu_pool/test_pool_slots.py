"""The CPU pool's slots: one allocation, seen as entries and as typed payloads."""

from __future__ import annotations

import pytest
import torch

from kvwire.blocks.format import (
    HEADER_SIZE,
    BlockLayout,
    headers_without_checksum,
    verify_entry,
    write_header,
)
from kvwire.media.cpu_pool.pool_memory import PoolSlots

LAYOUT = BlockLayout(num_layers=1, block_size=2, num_kv_heads=1, head_size=4, dtype="float32")
IN_PROCESS = BlockLayout(
    num_layers=1, block_size=2, num_kv_heads=1, head_size=4, dtype="float32", payload_checksum=False
)
HASHES = [bytes([n]) * 32 for n in (3, 1, 4)]


def test_a_slots_payload_is_the_entry_past_its_header() -> None:
    slots = PoolSlots(LAYOUT, 3)
    slots.payload(1).fill_(1.5)

    entry = slots.entry(1)
    assert len(entry) == LAYOUT.entry_bytes
    assert bytes(entry[:HEADER_SIZE]) == bytes(HEADER_SIZE)
    payload = torch.frombuffer(bytearray(entry[HEADER_SIZE:]), dtype=torch.float32)
    assert payload.eq(1.5).all()
    # The neighbours are untouched.
    assert not slots.payload(0).any() and not slots.payload(2).any()
    assert slots.payloads.shape == (3, *LAYOUT.shape)


def test_the_pool_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="the CPU pool needs at least one slot, got 0"):
        PoolSlots(LAYOUT, 0)


def test_headers_written_together_are_those_each_entry_gets_alone_and_verify() -> None:
    alone = PoolSlots(IN_PROCESS, 5)
    together = PoolSlots(IN_PROCESS, 5)
    slots = [4, 0, 2]
    for slot, block_hash in zip(slots, HASHES, strict=True):
        write_header(alone.entry(slot), IN_PROCESS, block_hash)

    together.set_headers(slots, headers_without_checksum(IN_PROCESS, HASHES))

    assert [bytes(together.entry(slot)) for slot in range(5)] == [
        bytes(alone.entry(slot)) for slot in range(5)
    ]
    assert together.headers(slots) == headers_without_checksum(IN_PROCESS, HASHES)
    for slot, block_hash in zip(slots, HASHES, strict=True):
        verify_entry(together.entry(slot), IN_PROCESS, block_hash)
    together.clear_headers(slots[:2])
    assert together.headers(slots[:2]) == bytes(2 * HEADER_SIZE)
    assert together.headers(slots[2:]) == headers_without_checksum(IN_PROCESS, HASHES[2:])


def test_headers_are_written_together_only_where_the_payload_has_no_checksum() -> None:
    with pytest.raises(ValueError, match="this layout checksums its payloads"):
        headers_without_checksum(LAYOUT, HASHES)
