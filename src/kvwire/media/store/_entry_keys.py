"""How a store medium names its entries: one object for the key scheme, both ways.

The transfer handler asks it for the key of a block of a group (to read,
write or discard the entry) and, for the keys a store reports removed, which
block and KV cache group each names (to report the removal in the KV cache
events; a key of another layout names no block of this engine).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from kvwire.blocks.format import BlockLayout, block_of_key
from kvwire.interface.types import BlockHash

__all__ = ["EntryKeys", "LayoutKeys"]


class EntryKeys(abc.ABC):
    """A key scheme: a block's key in each group, and the block a key names."""

    @abc.abstractmethod
    def key(self, group: int, block_hash: BlockHash) -> str:
        """The store key of the entry of `block_hash` in `group`."""

    @abc.abstractmethod
    def block_of(self, key: str) -> tuple[BlockHash, int | None] | None:
        """The block hash `key` names and its KV cache group (None if unknown).

        None for a key that names no block of this engine (another layout's).
        """


class LayoutKeys(EntryKeys):
    """Each group's entries under its layout's keys (`layout.key`).

    `layouts` are the handler's groups in order; with `per_cache_group`
    of them to each KV cache group (entries of groups of KV heads or
    layers), `block_of` names the KV cache group.
    """

    def __init__(self, layouts: Sequence[BlockLayout], per_cache_group: int = 1) -> None:
        self._layouts = tuple(layouts)
        self._per_cache_group = per_cache_group

    def key(self, group: int, block_hash: BlockHash) -> str:
        return self._layouts[group].key(block_hash)

    def block_of(self, key: str) -> tuple[BlockHash, int | None] | None:
        found = block_of_key(self._layouts, key)
        return None if found is None else (found[0], found[1] // self._per_cache_group)
