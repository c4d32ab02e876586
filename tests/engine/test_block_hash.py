"""Chained block hashes are stable, chained, and scoped to one model."""

from __future__ import annotations

import hashlib
import struct

from kvwire.config import ModelConfig
from kvwire.engine.block_hash import extend_block_hashes, hash_block, root_hash


def test_a_block_hash_is_sha256_of_parent_then_token_ids() -> None:
    parent = b"\x01" * 32
    expected = hashlib.sha256(parent + struct.pack("<3q", 1, 2, 3)).digest()
    assert hash_block(parent, [1, 2, 3]) == expected


def test_only_full_blocks_get_a_hash() -> None:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), block_size=4, root=b"r")
    assert len(hashes) == 2


def test_extending_appends_only_the_newly_full_blocks() -> None:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(6)), block_size=4, root=b"r")
    first = list(hashes)
    extend_block_hashes(hashes, list(range(8)), block_size=4, root=b"r")
    assert hashes[:1] == first and len(hashes) == 2


def test_equal_blocks_after_different_prefixes_hash_differently() -> None:
    left: list[bytes] = []
    right: list[bytes] = []
    extend_block_hashes(left, [1, 1, 1, 1, 5, 5, 5, 5], block_size=4, root=b"r")
    extend_block_hashes(right, [2, 2, 2, 2, 5, 5, 5, 5], block_size=4, root=b"r")
    assert left[1] != right[1]


def test_extra_keys_change_the_hash() -> None:
    assert hash_block(b"p", [1, 2]) != hash_block(b"p", [1, 2], extra_keys=("lora-a",))


def test_models_with_different_weights_have_different_roots() -> None:
    assert root_hash(ModelConfig(seed=0)) != root_hash(ModelConfig(seed=1))
    assert root_hash(ModelConfig(seed=0)) == root_hash(ModelConfig(seed=0))
