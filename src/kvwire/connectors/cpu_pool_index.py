"""The scheduler side's index of the CPU pool: which block hash lives in which slot.

Pure bookkeeping, no tensors: the worker side owns the pool memory and does
what this index decides. A slot holds one block (every layer, cross-layer
layout). Blocks are evicted least recently used first, but never while a load
reads them (``load_refs``) or a store writes them (not yet ``ready``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs

from kvwire.connector.types import BlockHash


@attrs.define
class _Slot:
    slot: int
    ready: bool = False
    load_refs: int = 0


class CPUPoolIndex:
    """An LRU over ``num_slots`` pool slots, keyed by block hash."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Least recently used first.
        self._blocks: OrderedDict[BlockHash, _Slot] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.evicted: list[BlockHash] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def is_ready(self, block_hash: BlockHash) -> bool:
        entry = self._blocks.get(block_hash)
        return entry is not None and entry.ready

    def count_ready_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, are stored and complete."""
        count = 0
        for block_hash in hashes:
            if not self.is_ready(block_hash):
                break
            count += 1
        return count

    def start_load(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pin ready blocks for a load and mark them recently used; their slots."""
        slots = []
        for block_hash in hashes:
            entry = self._blocks[block_hash]
            if not entry.ready:
                raise KeyError(f"block {block_hash.hex()[:16]} is not ready in the CPU pool")
            entry.load_refs += 1
            self._blocks.move_to_end(block_hash)
            slots.append(entry.slot)
        return slots

    def finish_load(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            entry = self._blocks.get(block_hash)
            if entry is not None and entry.load_refs > 0:
                entry.load_refs -= 1

    def prepare_store(self, hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, int]]:
        """Slots for the blocks not stored yet, evicting old blocks as needed.

        Blocks already in the pool (or being stored) are only refreshed. When
        every slot is pinned, the remaining blocks are not stored (the pool is
        a cache: skipping is correct, only less useful).
        """
        placed: list[tuple[BlockHash, int]] = []
        for block_hash in hashes:
            existing = self._blocks.get(block_hash)
            if existing is not None:
                self._blocks.move_to_end(block_hash)
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self._blocks[block_hash] = _Slot(slot)
            placed.append((block_hash, slot))
        return placed

    def complete_store(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Mark stored blocks ready for lookups; those that became ready."""
        completed = []
        for block_hash in hashes:
            entry = self._blocks.get(block_hash)
            if entry is not None and not entry.ready:
                entry.ready = True
                completed.append(block_hash)
        return completed

    def abandon_store(self, hashes: Sequence[BlockHash]) -> None:
        """Forget blocks whose store failed; their slots become free."""
        for block_hash in hashes:
            entry = self._blocks.get(block_hash)
            if entry is not None and not entry.ready and entry.load_refs == 0:
                del self._blocks[block_hash]
                self._free_slots.append(entry.slot)

    def discard(self, hashes: Sequence[BlockHash]) -> None:
        """Forget ready blocks found corrupt (unless a load still reads them); slots freed."""
        for block_hash in hashes:
            entry = self._blocks.get(block_hash)
            if entry is not None and entry.ready and entry.load_refs == 0:
                del self._blocks[block_hash]
                self._free_slots.append(entry.slot)
                self.evicted.append(block_hash)

    def take_evicted(self) -> list[BlockHash]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def clear(self) -> bool:
        """Drop every block that no transfer uses; True when the pool is empty after."""
        for block_hash, entry in list(self._blocks.items()):
            if entry.ready and entry.load_refs == 0:
                del self._blocks[block_hash]
                self._free_slots.append(entry.slot)
                self.evicted.append(block_hash)
        return not self._blocks

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, entry in self._blocks.items():
            if entry.ready and entry.load_refs == 0:
                del self._blocks[block_hash]
                self.evicted.append(block_hash)
                return entry.slot
        return None
