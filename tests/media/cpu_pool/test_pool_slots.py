"""The CPU pool's slots: one allocation, seen as entries and as typed payloads."""

from __future__ import annotations

import pytest
import torch

from kvwire.blocks.format import HEADER_SIZE, BlockLayout
from kvwire.media.cpu_pool._pool_memory import PoolSlots

LAYOUT = BlockLayout(num_layers=1, block_size=2, num_kv_heads=1, head_size=4, dtype="float32")


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
