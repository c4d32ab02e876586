"""Entries as a writer without the MAC key forges them: other KV, and a checksum that matches."""

from __future__ import annotations

import struct

import torch

from kvwire.blocks.format import HEADER_SIZE, payload_checksum

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
