"""The on-store format of one KV block: a fixed header, then the raw bytes.

Every stored block carries a header that says what it is (layout
fingerprint, dtype, shape, the block hash it was stored under) and a checksum
of its payload, so that a missing, torn, corrupted or foreign entry is
recognised before a single byte of it reaches the KV cache. No pickle: the
header is a fixed ``struct`` and the payload is the cache's own bytes.

The payload of a block is every layer's keys and values for that block, in
the order ``[num_layers, 2, block_size, num_kv_heads, head_size]`` (the
"cross-layer" layout: one entry per block, so transfers are large).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import NoReturn

import attrs
import xxhash

from kvwire.config import DTYPE_SIZES, EngineConfig
from kvwire.connector.types import BlockHash

MAGIC = b"KVWB"
FORMAT_VERSION = 1
# Fixed, and a multiple of 64, so the payload that follows it in a staging
# buffer stays aligned for any dtype view.
HEADER_SIZE = 128
CACHE_LAYOUT = "layers,2,block_size,num_kv_heads,head_size"

_DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(DTYPE_SIZES, start=1)}
# magic, version, dtype code, fingerprint, block hash, shape (5 dims), payload bytes, checksum
_HEADER = struct.Struct("<4sHH16s32s5IQQ")
assert _HEADER.size <= HEADER_SIZE


class CorruptBlockError(ValueError):
    """A stored entry that must not be loaded; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@attrs.frozen
class BlockLayout:
    """The shape of one stored block, and the fingerprint that names it.

    Engines whose layouts differ get different fingerprints, so they never
    load each other's bytes.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> BlockLayout:
        model = config.model_config
        return cls(
            num_layers=model.num_layers,
            block_size=config.cache_config.block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            dtype=model.dtype,
        )

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def payload_bytes(self) -> int:
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_size
            * DTYPE_SIZES[self.dtype]
        )

    @property
    def entry_bytes(self) -> int:
        """Header plus payload: the size of one stored entry."""
        return HEADER_SIZE + self.payload_bytes

    # Cached: the load path checks every entry's header against these.
    @functools.cached_property
    def fingerprint(self) -> bytes:
        description = (
            f"kvwire-block-v{FORMAT_VERSION};layout={CACHE_LAYOUT};shape={self.shape};"
            f"dtype={self.dtype}"
        )
        return hashlib.blake2b(description.encode(), digest_size=16).digest()

    @functools.cached_property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    @functools.cached_property
    def header_template(self) -> bytes:
        """This layout's header with a zero block hash and checksum, to compare entries against."""
        return _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            _DTYPE_CODES[self.dtype],
            self.fingerprint,
            bytes(32),
            *self.shape,
            self.payload_bytes,
            0,
        )

    def key(self, block_hash: BlockHash) -> str:
        """The store key of a block: layout fingerprint, then the block hash."""
        return f"{self.fingerprint_hex}/{block_hash.hex()}"

    def block_hash_of(self, key: str) -> BlockHash | None:
        """The block hash whose :meth:`key` is ``key``; None for another layout's key."""
        fingerprint, _, hash_hex = key.partition("/")
        if fingerprint != self.fingerprint_hex:
            return None
        try:
            block_hash = bytes.fromhex(hash_hex)
        except ValueError:
            return None
        # fromhex skips whitespace: only an exact round trip is one of our keys.
        return block_hash if self.key(block_hash) == key else None


def payload_checksum(payload: memoryview) -> int:
    """XXH3-64 of ``payload``.

    The hasher object is used rather than ``xxh3_64_intdigest`` because its
    constructor releases the GIL while it hashes (the one-shot function does
    not), so checksums on I/O threads overlap with the forward pass's thread.
    The value is the same.
    """
    return xxhash.xxh3_64(payload).intdigest()


def write_header(entry: memoryview, layout: BlockLayout, block_hash: BlockHash) -> None:
    """Fill ``entry[:HEADER_SIZE]`` for the payload already in ``entry[HEADER_SIZE:]``."""
    payload = entry[HEADER_SIZE : HEADER_SIZE + layout.payload_bytes]
    _HEADER.pack_into(
        entry,
        0,
        MAGIC,
        FORMAT_VERSION,
        _DTYPE_CODES[layout.dtype],
        layout.fingerprint,
        block_hash.ljust(32, b"\0")[:32],
        *layout.shape,
        layout.payload_bytes,
        payload_checksum(payload),
    )
    entry[_HEADER.size : HEADER_SIZE] = bytes(HEADER_SIZE - _HEADER.size)


# Where the block hash lies in the header, and where the checksum starts.
_HASH_START = struct.calcsize("<4sHH16s")
_HASH_END = _HASH_START + 32
_CHECKSUM_START = _HEADER.size - 8


def verify_entry(entry: memoryview, layout: BlockLayout, block_hash: BlockHash) -> None:
    """Raise :class:`CorruptBlockError` unless ``entry`` is this block, whole and intact."""
    if len(entry) < HEADER_SIZE:
        raise CorruptBlockError(f"entry is {len(entry)} bytes, shorter than its header")
    template = layout.header_template
    payload_bytes = layout.payload_bytes
    if (
        len(entry) >= HEADER_SIZE + payload_bytes
        and entry[:_HASH_START] == template[:_HASH_START]
        and entry[_HASH_START:_HASH_END] == block_hash.ljust(32, b"\0")[:32]
        and entry[_HASH_END:_CHECKSUM_START] == template[_HASH_END:_CHECKSUM_START]
    ):
        # The usual case, in three comparisons; only the checksum is left.
        (checksum,) = struct.unpack_from("<Q", entry, _CHECKSUM_START)
        if payload_checksum(entry[HEADER_SIZE : HEADER_SIZE + payload_bytes]) != checksum:
            raise CorruptBlockError("payload checksum mismatch")
        return
    _raise_header_error(entry, layout, block_hash)


def _raise_header_error(entry: memoryview, layout: BlockLayout, block_hash: BlockHash) -> NoReturn:
    """Say which header field is wrong (or, failing that, that the checksum is)."""
    values = _HEADER.unpack_from(entry, 0)
    magic, version, dtype_code, fingerprint, stored_hash = values[:5]
    shape = tuple(values[5:10])
    payload_bytes = values[10]
    # Field by field, so that the error names what is wrong.
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version {version}, expected {FORMAT_VERSION}")
    if fingerprint != layout.fingerprint:
        raise CorruptBlockError("layout fingerprint differs from this engine's")
    if dtype_code != _DTYPE_CODES[layout.dtype] or shape != layout.shape:
        raise CorruptBlockError(f"dtype/shape {dtype_code}/{shape} differ from {layout.shape}")
    if stored_hash != block_hash.ljust(32, b"\0")[:32]:
        raise CorruptBlockError("entry was stored under another block hash")
    if payload_bytes != layout.payload_bytes or len(entry) < HEADER_SIZE + payload_bytes:
        raise CorruptBlockError(
            f"payload is {len(entry) - HEADER_SIZE} bytes (header says {payload_bytes}), "
            f"expected {layout.payload_bytes}"
        )
    raise CorruptBlockError("header does not match this block")
