"""Encoded block entries for the store tests, built with the real block format."""

from __future__ import annotations

import hashlib
import random

from kvwire.blocks.format import BlockLayout, write_header

SMALL_LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")


def block_hash(index: int) -> bytes:
    return hashlib.sha256(f"block-{index}".encode()).digest()


def encoded_entry(layout: BlockLayout, index: int, seed: int = 0) -> bytearray:
    """A whole, valid entry for block ``index`` with a payload drawn from ``seed``."""
    entry = bytearray(layout.entry_bytes)
    payload = random.Random(seed * 1_000_003 + index).randbytes(layout.payload_bytes)
    entry[layout.entry_bytes - layout.payload_bytes :] = payload
    write_header(memoryview(entry), layout, block_hash(index))
    return entry


def store_keys(layout: BlockLayout, count: int) -> list[str]:
    return [layout.key(block_hash(index)) for index in range(count)]
