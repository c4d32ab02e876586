"""The CPU pool medium's scheduler half: the pool's index behind the MediumIndex calls.

`SlotTable` decides which slot holds
which block; this half adds what the block connector expects of a medium:
the KV cache events (one per KV cache group that changed, in the order the
changes happened) and the counts of blocks evicted and of stores the pool had
no room for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvwire.interface.types import BlockHash, BlockRemoved, BlockStored, KVCacheEvent
from kvwire.media.base import MediumIndex
from kvwire.media.cpu_pool._slot_table import SlotTable


class CPUPoolIndex(MediumIndex):
    """The pool's index over `num_slots` slots shared by `num_groups` KV cache groups.

    `medium` names the pool in the KV cache events.
    """

    def __init__(self, num_slots: int, num_groups: int, medium: str) -> None:
        self._index = SlotTable(num_slots, num_groups)
        self._medium = medium
        self._events: list[KVCacheEvent] = []
        self._counters: dict[str, int] = {}

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """Blocks being stored count only once their store completed."""
        return self._index.count_ready_prefix(group, block_hashes)

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """Pin the blocks (no eviction until `complete_load`); their slots, in order."""
        ready = self._index.count_ready_prefix(group, block_hashes)
        if ready < len(block_hashes):
            # Checked before pinning anything, so a refused load pins nothing.
            raise ValueError(
                f"prepare_load: the CPU pool holds {ready} of the {len(block_hashes)} blocks "
                f"asked for in KV cache group {group} (block {block_hashes[ready].hex()[:16]} "
                "is missing or still being stored); a load is prepared only for blocks "
                "count_held_prefix just counted"
            )
        return tuple(self._index.start_load(group, block_hashes))

    def complete_load(
        self, group: int, block_hashes: Sequence[BlockHash], corrupt: Sequence[BlockHash]
    ) -> None:
        """Unpin the blocks; a corrupt one would fail every later load, so it is forgotten."""
        self._index.finish_load(group, block_hashes)
        if corrupt:
            self._index.discard(group, corrupt)
            # Removed from the pool, yet not an eviction: not counted as one.
            self._record_evictions()

    def prepare_store(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        """A slot for each block the pool lacks, evicting the least recently used as needed.

        Blocks the pool holds (or is storing) are not copied again; blocks
        left out otherwise found every slot pinned, and count as
        `stores_skipped_pool_full`.
        """
        placed = self._index.prepare_store(group, block_hashes)
        placed_hashes = {block_hash for block_hash, _ in placed}
        skipped = sum(
            1
            for block_hash in block_hashes
            if block_hash not in placed_hashes and not self._index.holds(group, block_hash)
        )
        self._count("stores_skipped_pool_full", skipped)
        self._count("evicted_blocks", self._record_evictions())
        return [(block_hash, slot) for block_hash, slot in placed]

    def complete_store(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        """Made: the blocks become hits (a stored event). Not made: their slots are freed."""
        if not success:
            self._index.abandon_store(group, block_hashes)
            return
        completed = self._index.complete_store(group, block_hashes)
        if completed:
            self._events.append(
                BlockStored(block_hashes=tuple(completed), medium=self._medium, group=group)
            )

    def take_events(self) -> list[KVCacheEvent]:
        """Blocks removed (evicted, discarded, cleared) and stored, in the order it happened."""
        events, self._events = self._events, []
        return events

    def take_counters(self) -> Mapping[str, int]:
        """`evicted_blocks` and `stores_skipped_pool_full` since the last call, when not 0."""
        counters, self._counters = self._counters, {}
        return counters

    def reset(self) -> bool:
        """Forget every block no transfer uses; True when the pool is empty after."""
        emptied = self._index.clear()
        self._record_evictions()
        return emptied

    def _count(self, name: str, amount: int) -> None:
        if amount:
            self._counters[name] = self._counters.get(name, 0) + amount

    def _record_evictions(self) -> int:
        """A removed event per group whose blocks left the pool since the last call; how many."""
        count = 0
        for group, evicted in enumerate(self._index.take_evicted()):
            if evicted:
                self._events.append(
                    BlockRemoved(block_hashes=tuple(evicted), medium=self._medium, group=group)
                )
                count += len(evicted)
        return count
