"""Chained block hashes: the identity of a block of tokens in its context.

A block's hash is the sha256 of its parent's hash, its token ids and any
extra keys, so equal hashes mean equal prefixes. It is stable across
processes, machines and runs (never Python's `hash()`), which is what lets
one engine load blocks another engine stored.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvwire.config import ModelConfig
from kvwire.interface.types import BlockHash


def root_hash(model_config: ModelConfig) -> BlockHash:
    """The parent of every first block: the model's identity.

    Two models that differ in weights or shape never share a block hash, so a
    connector's store cannot hand one model's KV to another.
    """
    return hashlib.sha256(model_config.weights_description.encode()).digest()


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """The chained hash of one full block."""
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        digest.update(b"\0" + key.encode())
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    extra_keys: Sequence[str] = (),
) -> None:
    """Append the hash of every block of `token_ids` that became full."""
    for block_index in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[-1] if block_hashes else root
        start = block_index * block_size
        block_hashes.append(hash_block(parent, token_ids[start : start + block_size], extra_keys))
