"""Block entries for the store and block-format tests.

Encoded with the real block format, and forged as a writer without the MAC key
would forge them.
"""

from __future__ import annotations

import hashlib
import random
import struct

import torch

from kvwire.blocks.format import HEADER_SIZE, BlockLayout, payload_checksum, write_header

# Encoded block entries for the store tests, built with the real block format.

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


# Entries as a writer without the MAC key forges them: other KV, and a checksum that matches.

CHECKSUM_AT = struct.calcsize("<4sHH16s32s5IQ")
FLAGS_AT = CHECKSUM_AT + 8


def forge(entry: bytes, unseal: bool = False) -> bytes:
    """``entry`` with KV of the forger's choice and a checksum that matches it.

    The tiny test models' caches hold float32: large finite values, so that
    attention really changes. ``unseal`` also clears the flags and the MAC, as
    a writer without the key would write the entry.
    """
    forged = bytearray(entry)
    count = (len(forged) - HEADER_SIZE) // 4
    values = torch.randn(count, generator=torch.Generator().manual_seed(len(entry))) * 50
    forged[HEADER_SIZE:] = values.numpy().tobytes()
    struct.pack_into("<Q", forged, CHECKSUM_AT, payload_checksum(memoryview(forged)[HEADER_SIZE:]))
    if unseal:
        forged[FLAGS_AT:HEADER_SIZE] = bytes(HEADER_SIZE - FLAGS_AT)
    return bytes(forged)
