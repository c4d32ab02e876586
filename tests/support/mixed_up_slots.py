"""CPU pool slots whose header names another block or layout: what a slot reused or mixed up
looks like. The pool's payloads carry no checksum (only kvwire writes that memory), so these
headers are what a load must refuse."""

from __future__ import annotations

import struct

from kvwire.media.cpu_pool.pool_memory import PoolSlots

# Where the header's layout fingerprint and block hash lie (kvwire.blocks.format's header).
FINGERPRINT_AT = struct.calcsize("<4sHH")
BLOCK_HASH_AT = struct.calcsize("<4sHH16s")


def name_another_block(pool: PoolSlots, slot: int) -> None:
    """Make ``slot``'s header name another block hash; its payload is left as it is."""
    pool.entry(slot)[BLOCK_HASH_AT] ^= 0x01


def name_another_layout(pool: PoolSlots, slot: int) -> None:
    """Make ``slot``'s header name another layout fingerprint; its payload is left as it is."""
    pool.entry(slot)[FINGERPRINT_AT] ^= 0x01
