"""The on-store format of one KV block: a fixed header, then the raw bytes.

Every stored block carries a header that says what it is (layout
fingerprint, dtype, shape, the block hash it was stored under) and a checksum
of its payload, so that a missing, torn, corrupted or foreign entry is
recognised before a single byte of it reaches the KV cache. No pickle: the
header is a fixed `struct` and the payload is the cache's own bytes.

With a MAC key (`kvwire.blocks.mac`), the header's flags say
that the entry is sealed, its last 32 bytes hold the MAC of the rest of the
header and the payload, and the layout fingerprint names the key's id: such
entries and unsealed ones never share a name, and one found under the other's
name is a load error.

An entry in memory kvwire allocated in this process, which only kvwire
writes (the CPU pool), carries no payload checksum
(`BlockLayout.payload_checksum` false, the header flag
`FLAG_NO_CHECKSUM`): such memory does not rot or tear between a store and a
load, so a pass over every byte would guard against nothing; the header
still names the block and its layout, so a slot reused or mixed up is never
loaded as another block. A layout that checksums (every store, and a pool
other processes read) refuses such an entry as corrupt.

The payload of a block is every layer's keys and values for that block, in
the order `[num_layers, 2, block_size, num_kv_heads, head_size]` (the
"cross-layer" layout: one entry per block, so transfers are large).

An entry may hold only some of the model's KV heads (`HeadShard`)
and layers (`LayerShard`): a tensor-parallel engine's rank holds a
share of every layer's heads, a pipeline stage some of the layers, and a
store keeps one entry per block, group of heads and group of layers, at a
granularity that does not depend on how the writer was split (see
`kvwire.blocks.shards`). The heads and layers an entry holds are in its
layout's fingerprint (so in its key and header): an entry of others is
never found under this one's name, and one found there anyway is a load
error. An entry of all the model's heads and layers keeps the fingerprint
it always had.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import NoReturn

import attrs
import xxhash

from kvwire.blocks.mac import MAC_SIZE, EntryMac
from kvwire.config import EngineConfig
from kvwire.config.dtypes import DTYPES
from kvwire.exceptions import CorruptBlockError as CorruptBlockError
from kvwire.interface.types import BlockHash

MAGIC = b"KVWB"
FORMAT_VERSION = 1
# Fixed, and a multiple of 64, so the payload that follows it in a staging
# buffer stays aligned for any dtype view.
HEADER_SIZE = 128
CACHE_LAYOUT = "layers,2,block_size,num_kv_heads,head_size"
# What a payload's bytes mean, by the engine's paged cache layout
# (`CacheConfig.kv_cache_layout`). vLLM's CPU blocks are copied whole, packing
# and all: the payload is each layer's block as vLLM holds it.
PAYLOAD_LAYOUTS: dict[str, str] = {
    "kvwire": CACHE_LAYOUT,
    "vllm_cpu": "layers,vllm_cpu_block[num_kv_heads,block_size,2*head_size]",
}

_DTYPE_CODES: dict[str, int] = {name: dtype.code for name, dtype in DTYPES.items()}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}
# magic, version, dtype code, fingerprint, block hash, shape (5 dims), payload bytes,
# checksum, flags; the MAC (or zeros) fills the rest of the header.
_HEADER = struct.Struct("<4sHH16s32s5IQQI")
assert _HEADER.size + MAC_SIZE == HEADER_SIZE
# Entries written before flags existed have zeros there: unsealed, checksummed.
FLAG_SEALED = 0x1
# The payload carries no checksum: written only into this process's own memory.
FLAG_NO_CHECKSUM = 0x2
_UNSEALED_MAC = bytes(MAC_SIZE)


@attrs.frozen
class HeadShard:
    """Which of the model's KV heads an entry holds: `[start, stop)` of `total`."""

    start: int
    stop: int
    total: int
    what = "KV heads"

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.total:
            raise ValueError(
                f"{self.what} [{self.start}, {self.stop}) are not a range of the model's "
                f"{self.total} {self.what}"
            )

    @property
    def count(self) -> int:
        return self.stop - self.start

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.stop == self.total

    def describe(self) -> str:
        return f"{self.start}:{self.stop}/{self.total}"


@attrs.frozen
class LayerShard(HeadShard):
    """Which of the model's layers an entry holds (by index in the whole model)."""

    what = "layers"


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
    # The MAC that seals and checks this layout's entries; None: checksum only.
    mac: EntryMac | None = attrs.field(default=None, kw_only=True)
    # The engine's paged cache layout (a key of PAYLOAD_LAYOUTS) and the model's
    # identity: both name the entries, so engines share them only when the
    # bytes mean the same thing.
    cache_layout: str = attrs.field(default="kvwire", kw_only=True)
    model_identity: str = attrs.field(default="", kw_only=True)
    # The KV cache group whose layers an entry holds (`CacheGroup.name`), in
    # a hybrid engine; "" with a single group.
    group: str = attrs.field(default="", kw_only=True)
    # The KV heads an entry holds when not all of the model's (`num_kv_heads`
    # is then their count); None: all of them.
    kv_heads: HeadShard | None = attrs.field(default=None, kw_only=True)
    # The layers an entry holds when not all of the model's (`num_layers` is
    # then their count; a pipeline stage holds some); None: all of them.
    layers: LayerShard | None = attrs.field(default=None, kw_only=True)
    # False only for entries in memory kvwire allocated in this process and
    # only kvwire writes (the CPU pool): their payload is neither checksummed
    # nor verified (see the module docstring). Not part of the fingerprint.
    payload_checksum: bool = attrs.field(default=True, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.mac is not None and not self.payload_checksum:
            raise ValueError(
                "BlockLayout: a MAC seals entries another writer could reach; "
                "payload_checksum=False is for this process's own memory only"
            )

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> BlockLayout:
        model = config.model_config
        return cls(
            num_layers=model.num_layers,
            block_size=config.cache_config.block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_size,
            dtype=model.dtype,
            cache_layout=config.cache_config.kv_cache_layout,
            model_identity=model.weights_identity,
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
            * DTYPES[self.dtype].size
        )

    @property
    def entry_bytes(self) -> int:
        """Header plus payload: the size of one stored entry."""
        return HEADER_SIZE + self.payload_bytes

    # Cached: the load path checks every entry's header against these.
    @functools.cached_property
    def fingerprint(self) -> bytes:
        description = (
            f"kvwire-block-v{FORMAT_VERSION};layout={PAYLOAD_LAYOUTS[self.cache_layout]};"
            f"shape={self.shape};dtype={self.dtype}"
        )
        if self.model_identity:
            description += f";model={self.model_identity}"
        if self.group:
            description += f";{self.group}"
        if self.kv_heads is not None and not self.kv_heads.is_whole:
            description += f";kv_heads={self.kv_heads.describe()}"
        if self.layers is not None and not self.layers.is_whole:
            description += f";layers={self.layers.describe()}"
        if self.mac is not None:
            # Sealed entries (and each key's) get names of their own.
            description += f";mac={self.mac.key_id}"
        return hashlib.blake2b(description.encode(), digest_size=16).digest()

    @functools.cached_property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    @functools.cached_property
    def header_flags(self) -> int:
        if self.mac is not None:
            return FLAG_SEALED
        return 0 if self.payload_checksum else FLAG_NO_CHECKSUM

    @functools.cached_property
    def expected_header_fields(self) -> tuple[bytes, bytes, bytes]:
        """What every entry's header of this layout holds around its block hash and checksum.

        Three byte strings: the header up to the block hash, from the hash to
        the checksum, and the flags; compared as they are, field by field
        only when they differ.
        """
        template = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            _DTYPE_CODES[self.dtype],
            self.fingerprint,
            bytes(32),
            *self.shape,
            self.payload_bytes,
            0,
            self.header_flags,
        )
        return (
            template[:_HASH_START],
            template[_HASH_END:_CHECKSUM_START],
            template[_CHECKSUM_END:_MAC_START],
        )

    def key(self, block_hash: BlockHash) -> str:
        """The store key of a block: layout fingerprint, then the block hash."""
        return f"{self.fingerprint_hex}/{block_hash.hex()}"

    def block_hash_of(self, key: str) -> BlockHash | None:
        """The block hash whose `kvwire.media.BlockLayout.key` is `key`; None for another
        layout's key."""
        fingerprint, _, hash_hex = key.partition("/")
        if fingerprint != self.fingerprint_hex:
            return None
        try:
            block_hash = bytes.fromhex(hash_hex)
        except ValueError:
            return None
        # fromhex skips whitespace: only an exact round trip is one of our keys.
        return block_hash if self.key(block_hash) == key else None


def block_of_key(layouts: Sequence[BlockLayout], key: str) -> tuple[BlockHash, int] | None:
    """The block hash `key` names and which of `layouts` made it (its KV cache group).

    None for a key none of them made (another engine's layout, a foreign key).
    """
    for group, layout in enumerate(layouts):
        block_hash = layout.block_hash_of(key)
        if block_hash is not None:
            return block_hash, group
    return None


def payload_checksum(payload: memoryview) -> int:
    """XXH3-64 of `payload`.

    The hasher object is used rather than `xxh3_64_intdigest` because its
    constructor releases the GIL while it hashes (the one-shot function does
    not), so checksums on I/O threads overlap with the forward pass's thread.
    The value is the same.
    """
    return xxhash.xxh3_64(payload).intdigest()


def parts_checksum(parts: Sequence[memoryview]) -> int:
    """XXH3-64 of the concatenation of `parts`, read where they lie (the same value as
    `payload_checksum` of the joined bytes; `update` releases the GIL too)."""
    if len(parts) == 1:
        return payload_checksum(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def write_header(entry: memoryview, layout: BlockLayout, block_hash: BlockHash) -> None:
    """Fill `entry[:HEADER_SIZE]` for the payload already in `entry[HEADER_SIZE:]`.

    With a MAC, the header (checksum included) and the payload are sealed
    here too, read where they lie, while the payload is still in the CPU cache.
    """
    payload = entry[HEADER_SIZE : HEADER_SIZE + layout.payload_bytes]
    encode_header(entry[:HEADER_SIZE], (payload,), layout, block_hash)


def headers_without_checksum(layout: BlockLayout, block_hashes: Sequence[BlockHash]) -> bytearray:
    """The headers `write_header` gives these blocks' entries, one after the other.

    Only for a layout with no payload checksum (and so no MAC): each header
    then depends on its block hash alone, so a pool writes or checks many
    entries' headers with one copy or one comparison instead of one call each.
    """
    if layout.payload_checksum:
        raise ValueError("headers_without_checksum: this layout checksums its payloads")
    before_hash, before_checksum, flags = layout.expected_header_fields
    after_hash = before_checksum + bytes(_CHECKSUM_END - _CHECKSUM_START) + flags + _UNSEALED_MAC
    # A bytearray, so that a pool can copy it into its slots without another copy.
    return bytearray().join(
        before_hash + block_hash.ljust(32, b"\0")[:32] + after_hash for block_hash in block_hashes
    )


def encode_header(
    header: memoryview, payload: Sequence[memoryview], layout: BlockLayout, block_hash: BlockHash
) -> None:
    """Fill `header` (`HEADER_SIZE` bytes) for the payload made of `payload`'s parts.

    The parts are a block's ranges in the KV cache (see
    `kvwire.blocks.memory`): checksum (unless the layout has none) and MAC are computed
    over them where they lie, equal to those of the joined payload, so the
    entry `header + parts` is the one `write_header` makes.
    """
    _HEADER.pack_into(
        header,
        0,
        MAGIC,
        FORMAT_VERSION,
        _DTYPE_CODES[layout.dtype],
        layout.fingerprint,
        block_hash.ljust(32, b"\0")[:32],
        *layout.shape,
        layout.payload_bytes,
        parts_checksum(payload) if layout.payload_checksum else 0,
        layout.header_flags,
    )
    if layout.mac is None:
        header[_MAC_START:HEADER_SIZE] = _UNSEALED_MAC
    else:
        header[_MAC_START:HEADER_SIZE] = layout.mac.seal(header[:_MAC_START], *payload)


# Where the block hash lies in the header, where the checksum and the MAC start.
_HASH_START = struct.calcsize("<4sHH16s")
_HASH_END = _HASH_START + 32
_CHECKSUM_START = struct.calcsize("<4sHH16s32s5IQ")
_CHECKSUM_END = _CHECKSUM_START + 8
_MAC_START = _HEADER.size


def verify_entry(entry: memoryview, layout: BlockLayout, block_hash: BlockHash) -> None:
    """Raise `kvwire.media.CorruptBlockError` unless `entry` is this block,
    whole and intact.

    With a MAC, the MAC alone decides (it covers the checksum and all the
    rest); only an entry that fails it is checksummed, to tell damage from forgery.
    A layout without payload checksum checks the header alone.
    """
    if len(entry) < HEADER_SIZE:
        raise CorruptBlockError(f"entry is {len(entry)} bytes, shorter than its header")
    # The payload's view is released before an error leaves: a log handler that
    # keeps the error (and its traceback) must not pin a mapped entry open.
    with (
        entry[:HEADER_SIZE] as header,
        entry[HEADER_SIZE : HEADER_SIZE + layout.payload_bytes] as payload,
    ):
        verify_parts(header, (payload,), len(entry), layout, block_hash)


def verify_parts(
    header: memoryview,
    payload: Sequence[memoryview],
    size: int,
    layout: BlockLayout,
    block_hash: BlockHash,
) -> None:
    """`verify_entry` of an entry read as `header` then `payload`'s parts, `size` bytes.

    The parts are where a load read the payload (the block's ranges in the KV
    cache); they are checked where they lie, nothing is joined. `size` is
    the entry's length as read: one shorter than header and payload is
    corrupt whatever the parts hold.
    """
    if size < HEADER_SIZE or len(header) < HEADER_SIZE:
        raise CorruptBlockError(f"entry is {size} bytes, shorter than its header")
    before_hash, before_checksum, flags = layout.expected_header_fields
    if not (
        size >= HEADER_SIZE + layout.payload_bytes
        and sum(len(part) for part in payload) == layout.payload_bytes
        and header[:_HASH_START] == before_hash
        and header[_HASH_START:_HASH_END] == block_hash.ljust(32, b"\0")[:32]
        and header[_HASH_END:_CHECKSUM_START] == before_checksum
        and header[_CHECKSUM_END:_MAC_START] == flags
    ):
        _raise_header_error(header, size, layout, block_hash)
    # The usual case, in four comparisons; only the payload's integrity is left.
    if not layout.payload_checksum:
        return  # this process's own memory: the header is all there is to check
    mac = layout.mac
    if mac is not None and mac.matches(
        header[_MAC_START:HEADER_SIZE], header[:_MAC_START], *payload
    ):
        return
    (checksum,) = struct.unpack_from("<Q", header, _CHECKSUM_START)
    if parts_checksum(payload) != checksum:
        raise CorruptBlockError("payload checksum mismatch")
    if mac is not None:
        raise CorruptBlockError(
            "MAC mismatch with an intact checksum: the entry was not written with this "
            f"engine's MAC key (${mac.variable}); forged, or a bug"
        )


def _raise_header_error(
    header: memoryview, size: int, layout: BlockLayout, block_hash: BlockHash
) -> NoReturn:
    """Say which header field is wrong (or, failing that, that the checksum is)."""
    values = _HEADER.unpack_from(header, 0)
    magic, version, dtype_code, fingerprint, stored_hash = values[:5]
    shape = tuple(values[5:10])
    payload_bytes, flags = values[10], values[12]
    # Field by field, so that the error names what is wrong.
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version {version}, expected {FORMAT_VERSION}")
    if flags != layout.header_flags:
        raise CorruptBlockError(_flags_error(flags, layout))
    if fingerprint != layout.fingerprint:
        raise CorruptBlockError("layout fingerprint differs from this engine's")
    if dtype_code != _DTYPE_CODES[layout.dtype]:
        found = _DTYPE_NAMES.get(dtype_code, f"code {dtype_code}")
        raise CorruptBlockError(f"dtype {found}, expected {layout.dtype}")
    if shape != layout.shape:
        raise CorruptBlockError(f"shape {shape}, expected {layout.shape}")
    if stored_hash != block_hash.ljust(32, b"\0")[:32]:
        raise CorruptBlockError("entry was stored under another block hash")
    if payload_bytes != layout.payload_bytes or size < HEADER_SIZE + payload_bytes:
        raise CorruptBlockError(
            f"payload is {size - HEADER_SIZE} bytes (header says {payload_bytes}), "
            f"expected {layout.payload_bytes}"
        )
    raise CorruptBlockError("header does not match this block")


def _flags_error(flags: int, layout: BlockLayout) -> str:
    if flags & ~(FLAG_SEALED | FLAG_NO_CHECKSUM) or flags == FLAG_SEALED | FLAG_NO_CHECKSUM:
        return f"unknown header flags {flags:#x}"
    if flags & FLAG_NO_CHECKSUM:
        return (
            "entry carries no payload checksum, which only a pool in the writer's own "
            "process may hold; not loaded from a medium that checks every payload"
        )
    if not layout.payload_checksum:
        return "entry carries a payload checksum: not written by this process's pool"
    if layout.mac is not None:
        return (
            "entry is not sealed with a MAC, and this engine requires one (MAC key from "
            f"${layout.mac.variable}): forged, or written by an engine without the key"
        )
    return "entry is sealed with a MAC, and this engine has no MAC key (mac_key_env)"
