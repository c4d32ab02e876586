"""The on-store block format: a good entry verifies, and each kind of damage is named."""

from __future__ import annotations

import struct

import pytest

from kvwire.connectors.block_format import (
    HEADER_SIZE,
    BlockLayout,
    CorruptBlockError,
    verify_entry,
    write_header,
)

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
BLOCK_HASH = bytes(range(32))


def encoded(layout: BlockLayout = LAYOUT, block_hash: bytes = BLOCK_HASH) -> bytearray:
    entry = bytearray(layout.entry_bytes)
    entry[HEADER_SIZE:] = bytes(i % 251 for i in range(layout.payload_bytes))
    write_header(memoryview(entry), layout, block_hash)
    return entry


def test_an_intact_entry_verifies() -> None:
    verify_entry(memoryview(encoded()), LAYOUT, BLOCK_HASH)


def test_a_longer_buffer_holding_the_entry_verifies() -> None:
    # Stores read into buffers that may be larger than the entry.
    verify_entry(memoryview(encoded() + bytes(64)), LAYOUT, BLOCK_HASH)


@pytest.mark.parametrize(
    ("offset", "reason"),
    [
        (0, "bad magic"),
        (4, "format version"),
        (6, "dtype/shape"),
        (8, "layout fingerprint differs"),
        (24, "stored under another block hash"),
        (56, "dtype/shape"),
        (76, "header says"),
        (84, "checksum mismatch"),
        (HEADER_SIZE - 8, "checksum mismatch"),  # the unused tail of the header
        (HEADER_SIZE, "checksum mismatch"),
        (HEADER_SIZE + LAYOUT.payload_bytes - 1, "checksum mismatch"),
    ],
)
def test_each_damaged_field_is_named(offset: int, reason: str) -> None:
    entry = encoded()
    entry[offset] ^= 0x01
    if offset == HEADER_SIZE - 8:
        # Padding is not covered by the checksum: damage there alone is harmless.
        verify_entry(memoryview(entry), LAYOUT, BLOCK_HASH)
        entry[HEADER_SIZE] ^= 0x01
    with pytest.raises(CorruptBlockError, match=reason):
        verify_entry(memoryview(entry), LAYOUT, BLOCK_HASH)


def test_the_stored_checksum_itself_damaged_is_a_mismatch() -> None:
    entry = encoded()
    checksum_at = struct.calcsize("<4sHH16s32s5IQ")
    entry[checksum_at] ^= 0x80
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        verify_entry(memoryview(entry), LAYOUT, BLOCK_HASH)


def test_a_truncated_entry_is_named() -> None:
    entry = encoded()[:-1]
    reason = r"payload is \d+ bytes \(header says \d+\), expected"
    with pytest.raises(CorruptBlockError, match=reason):
        verify_entry(memoryview(entry), LAYOUT, BLOCK_HASH)


def test_an_entry_shorter_than_its_header_is_named() -> None:
    with pytest.raises(CorruptBlockError, match="shorter than its header"):
        verify_entry(memoryview(encoded()[:100]), LAYOUT, BLOCK_HASH)


def test_another_blocks_entry_is_refused() -> None:
    with pytest.raises(CorruptBlockError, match="another block hash"):
        verify_entry(memoryview(encoded()), LAYOUT, bytes(32))


def test_an_entry_of_another_layout_is_refused() -> None:
    other = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16")
    with pytest.raises(CorruptBlockError, match="fingerprint differs"):
        verify_entry(memoryview(encoded(other)), LAYOUT, BLOCK_HASH)


def test_short_block_hashes_are_padded_the_same_way_on_both_sides() -> None:
    short = b"\x07" * 20
    verify_entry(memoryview(encoded(block_hash=short)), LAYOUT, short)


def test_a_store_key_maps_back_to_its_block_hash_and_no_other_key_does() -> None:
    other = BlockLayout(num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
    key = LAYOUT.key(BLOCK_HASH)
    assert LAYOUT.block_hash_of(key) == BLOCK_HASH
    assert LAYOUT.block_hash_of(other.key(BLOCK_HASH)) is None
    assert LAYOUT.block_hash_of(f"{LAYOUT.fingerprint_hex}/not-hex") is None
    # fromhex would skip the space: only the exact key counts.
    assert LAYOUT.block_hash_of(f"{key[:-2]} {key[-2:]}") is None
    assert LAYOUT.block_hash_of("stray-file") is None
