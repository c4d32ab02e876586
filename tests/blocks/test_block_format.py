"""The on-store block format: a good entry verifies, and each kind of damage is named."""

from __future__ import annotations

import logging
import pathlib
import struct

import attrs
import pytest

from kvwire.blocks.format import (
    FLAG_NO_CHECKSUM,
    HEADER_SIZE,
    BlockLayout,
    CorruptBlockError,
    verify_entry,
    write_header,
)
from kvwire.blocks.mac import EntryMac
from kvwire.config import EngineConfig, ModelConfig
from tests.support.pairs import PairFactory, make_request

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
BLOCK_HASH = bytes(range(32))
BLOCK_TOKENS = 4
PROMPT = list(range(100, 109))  # two full blocks, one token left to compute
CHECKSUM_AT = struct.calcsize("<4sHH16s32s5IQ")


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
        (6, "dtype bfloat16, expected float16"),
        (8, "layout fingerprint differs"),
        (24, "stored under another block hash"),
        (56, r"shape \(3, 2, 4, 2, 8\), expected \(2, 2, 4, 2, 8\)"),
        (76, "header says"),
        (84, "checksum mismatch"),
        (92, "sealed with a MAC, and this engine has no MAC key"),  # the flags
        (HEADER_SIZE - 8, "checksum mismatch"),  # the MAC's place, unused without a key
        (HEADER_SIZE, "checksum mismatch"),
        (HEADER_SIZE + LAYOUT.payload_bytes - 1, "checksum mismatch"),
    ],
)
def test_each_damaged_field_is_named(offset: int, reason: str) -> None:
    entry = encoded()
    entry[offset] ^= 0x01
    if offset == HEADER_SIZE - 8:
        # Without a key the MAC's place is not read: damage there alone is harmless.
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


def test_an_unknown_dtype_code_is_named_beside_the_expected_dtype() -> None:
    entry = encoded()
    struct.pack_into("<H", entry, 6, 99)
    with pytest.raises(CorruptBlockError, match="dtype code 99, expected float16"):
        verify_entry(memoryview(entry), LAYOUT, BLOCK_HASH)


def test_unknown_header_flags_are_refused() -> None:
    entry = encoded()
    entry[92] |= 0x80
    with pytest.raises(CorruptBlockError, match="unknown header flags 0x80"):
        verify_entry(memoryview(entry), LAYOUT, BLOCK_HASH)


# What the CPU pool writes: this process's own memory, no payload checksum.
IN_PROCESS = attrs.evolve(LAYOUT, payload_checksum=False)


def test_an_in_process_entry_is_written_without_a_payload_checksum() -> None:
    entry = encoded(IN_PROCESS)
    assert entry[92] == FLAG_NO_CHECKSUM
    assert struct.unpack_from("<Q", entry, CHECKSUM_AT) == (0,)
    # Not named apart: the pool's slots are not found by name.
    assert IN_PROCESS.fingerprint == LAYOUT.fingerprint


def test_an_in_process_entry_verifies_without_a_pass_over_its_payload() -> None:
    entry = encoded(IN_PROCESS)
    entry[HEADER_SIZE + 5] ^= 0x01  # unseen: only kvwire writes this memory
    verify_entry(memoryview(entry), IN_PROCESS, BLOCK_HASH)


@pytest.mark.parametrize(
    ("offset", "reason"),
    [
        (8, "layout fingerprint differs"),
        (24, "entry was stored under another block hash"),
        (56, "shape"),
    ],
)
def test_an_in_process_entry_still_names_its_block_and_layout(offset: int, reason: str) -> None:
    entry = encoded(IN_PROCESS)
    entry[offset] ^= 0x01
    with pytest.raises(CorruptBlockError, match=reason):
        verify_entry(memoryview(entry), IN_PROCESS, BLOCK_HASH)


def test_an_entry_without_a_payload_checksum_is_refused_where_payloads_are_checked() -> None:
    # A store (directory, Redis) or a pool read from another process never
    # loads such an entry, whatever its payload holds.
    with pytest.raises(CorruptBlockError, match="carries no payload checksum") as refused:
        verify_entry(memoryview(encoded(IN_PROCESS)), LAYOUT, BLOCK_HASH)
    assert "only a pool in the writer's own process" in refused.value.reason


def test_a_checksummed_entry_is_not_taken_for_an_in_process_one() -> None:
    with pytest.raises(CorruptBlockError, match="carries a payload checksum"):
        verify_entry(memoryview(encoded()), IN_PROCESS, BLOCK_HASH)


def test_no_checksum_and_a_mac_together_are_refused() -> None:
    with pytest.raises(ValueError, match="payload_checksum=False is for this process"):
        BlockLayout(
            num_layers=2,
            block_size=4,
            num_kv_heads=2,
            head_size=8,
            dtype="float16",
            mac=EntryMac(b"k" * 32, variable="KVWIRE_TEST_KEY"),
            payload_checksum=False,
        )


def test_the_load_warning_names_the_found_and_the_expected_dtype(
    shared_storage_pair: PairFactory, storage_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    producer = shared_storage_pair(seed=1)
    request = make_request("p", PROMPT, BLOCK_TOKENS)
    producer.prefill(request, [3, 7, 1])
    assert producer.worker.wait_for_pending_saves(30)  # type: ignore[attr-defined]
    # The harness's engines hold float32; the entry now says float16.
    victim = next(p for p in storage_dir.rglob(request.block_hashes[0].hex()))
    data = bytearray(victim.read_bytes())
    struct.pack_into("<H", data, 6, 2)
    victim.write_bytes(bytes(data))
    consumer = shared_storage_pair()
    with caplog.at_level(logging.WARNING):
        consumer.prefill(make_request("c", PROMPT, BLOCK_TOKENS), [20, 21, 22])
    assert consumer.load_errors == {20}
    assert "dtype float16, expected float32" in caplog.text


def test_a_refused_entry_leaves_no_view_of_its_buffer_behind() -> None:
    # A log handler may keep the error and its traceback: a mapped entry must still close.
    entry = encoded()
    entry[-1] ^= 0x01
    view = memoryview(entry)
    with pytest.raises(CorruptBlockError, match="checksum mismatch") as kept:
        verify_entry(view, LAYOUT, BLOCK_HASH)
    view.release()
    entry.extend(b"\0")  # a BufferError while any view of the entry is alive
    assert kept.value.reason == "payload checksum mismatch"


def test_kvwire_engines_of_other_weights_name_their_entries_apart() -> None:
    # Seeds draw the weights: equal shapes, other KV.
    def layout(**model: object) -> BlockLayout:
        return BlockLayout.from_engine_config(EngineConfig(model_config=ModelConfig(**model)))

    assert layout(seed=1).fingerprint != layout(seed=2).fingerprint
    assert layout(seed=1).fingerprint == layout(seed=1).fingerprint
    # An operator's identity names them instead; two names, two fingerprints.
    assert layout(seed=1, identity="a").fingerprint == layout(seed=2, identity="a").fingerprint
    assert layout(identity="a").fingerprint != layout(identity="b").fingerprint
