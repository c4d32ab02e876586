"""The CPU pool's slot table: which block lives in which slot (the scheduler half's bookkeeping).

Pure bookkeeping, no tensors: the worker half owns the pool memory and does
what this index decides. A slot holds one block of one KV cache group (every
layer of the group, cross-layer layout); every group's entries have the same
size, so one pool serves them all. A block hash names an entry only together
with its group: group 0's entry for a hash and group 1's are two entries,
stored, loaded and evicted on their own.

Which block is evicted is the eviction policy's choice
(`kvwire.media.eviction`, least recently used by default), whatever the
block's group, but never while a load reads it (`load_refs`) or a save
writes it (not yet `ready`).

A tiered medium (`kvwire.media.tiered`) keeps slower tiers behind the pool:
it brings blocks in from them (`start_promotion`; another load of a block
being brought in shares its slot, `join_promotion`), marks the blocks its
tiers hold (`mark_clean`), and is told of each ready block evicted
(`on_evict`) so that it can spill the ones only the pool holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Set

import attrs

from kvwire.interface.types import BlockHash
from kvwire.media.eviction import EvictionPolicy, LRUPolicy


@attrs.define
class _Slot:
    slot: int
    group: int
    block_hash: BlockHash
    ready: bool = False
    load_refs: int = 0
    # The slower tiers hold this block too: evicting it loses nothing.
    clean: bool = False
    # Being brought in, and a load using it failed: forgotten once no load uses it.
    failed: bool = False


class SlotTable:
    """`num_slots` pool slots, keyed by (group, block hash), evicted in `policy`'s order.

    One dict per group finds an entry by its hash without building a key per
    lookup; one policy over the slots orders all groups' entries for
    eviction (an `LRUPolicy` when none is given). `on_evict` is called
    with `(group, block_hash, slot, clean)` for each ready block the policy
    evicts, before its slot is reused.
    """

    def __init__(
        self,
        num_slots: int,
        num_groups: int = 1,
        policy: EvictionPolicy | None = None,
        on_evict: Callable[[int, BlockHash, int, bool], None] | None = None,
    ) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_slots = num_slots
        self._by_group: tuple[dict[BlockHash, _Slot], ...] = tuple({} for _ in range(num_groups))
        self._by_slot: dict[int, _Slot] = {}
        self._policy = LRUPolicy(num_slots) if policy is None else policy
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._on_evict = on_evict
        # Entries no eviction may take: being saved or brought in, or read by a load.
        self._busy = 0
        # Per group: blocks evicted (or discarded) since the last take_evicted.
        self.evicted: tuple[list[BlockHash], ...] = tuple([] for _ in range(num_groups))

    def __len__(self) -> int:
        return len(self._by_slot)

    @property
    def busy(self) -> int:
        """How many slots hold a block being saved or brought in, or read by a load."""
        return self._busy

    def holds(self, group: int, block_hash: BlockHash) -> bool:
        """Whether `group`'s entry for `block_hash` is saved or being saved."""
        return block_hash in self._by_group[group]

    def arriving(self, group: int, block_hash: BlockHash) -> bool:
        """Whether `group`'s entry for `block_hash` is being brought in (`start_promotion`)."""
        entry = self._by_group[group].get(block_hash)
        return entry is not None and not entry.ready and entry.load_refs > 0

    def count_ready_prefix(self, group: int, hashes: Sequence[BlockHash]) -> int:
        """How many of `group`'s `hashes`, from the first, are saved and complete."""
        entries = self._by_group[group]
        count = 0
        for block_hash in hashes:
            entry = entries.get(block_hash)
            if entry is None or not entry.ready:
                break
            count += 1
        return count

    def start_load(self, group: int, hashes: Sequence[BlockHash]) -> list[int]:
        """Pin ready blocks for a load and mark them recently used; their slots."""
        entries = self._by_group[group]
        slots = []
        for block_hash in hashes:
            entry = entries[block_hash]
            if not entry.ready:
                raise KeyError(
                    f"block {block_hash.hex()[:16]} of group {group} is not ready in the CPU pool"
                )
            if entry.load_refs == 0:
                self._busy += 1
            entry.load_refs += 1
            slots.append(entry.slot)
        self._touch_tail_first(slots)
        return slots

    def finish_load(self, group: int, hashes: Sequence[BlockHash]) -> None:
        for _, entry in self._present(group, hashes):
            if entry.load_refs > 0:
                entry.load_refs -= 1
                if entry.load_refs == 0 and entry.ready:
                    self._busy -= 1

    def prepare_save(
        self,
        group: int,
        hashes: Sequence[BlockHash],
        continuing: Set[BlockHash] = frozenset(),
    ) -> list[tuple[BlockHash, int]]:
        """Slots for `group`'s blocks not saved yet, evicting old blocks as needed.

        Blocks already in the pool (or being saved) are only refreshed. When
        every slot is pinned, the remaining blocks are not saved (the pool is
        a cache: skipping is correct, only less useful). New blocks in
        `continuing` continue an earlier prompt: the policy is told so
        (`EvictionPolicy.insert_continuing`).
        """
        entries = self._by_group[group]
        placed: list[tuple[BlockHash, int]] = []
        touched: list[int] = []
        new_slots: set[int] = set()
        for block_hash in hashes:
            existing = entries.get(block_hash)
            if existing is not None:
                touched.append(existing.slot)
                continue
            slot = self._take_slot()
            if slot is None:
                break
            entry = _Slot(slot, group, block_hash)
            entries[block_hash] = entry
            self._by_slot[slot] = entry
            self._busy += 1
            placed.append((block_hash, slot))
            touched.append(slot)
            new_slots.add(slot)
        self._touch_tail_first(touched, new_slots, continuing)
        return placed

    def complete_save(self, group: int, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Mark `group`'s saved blocks ready for lookups; those that became ready."""
        completed = []
        for block_hash, entry in self._present(group, hashes):
            if not entry.ready:
                entry.ready = True
                if entry.load_refs == 0:
                    self._busy -= 1
                completed.append(block_hash)
        return completed

    def abandon_save(self, group: int, hashes: Sequence[BlockHash]) -> None:
        """Forget `group`'s blocks whose save failed; their slots become free."""
        for _, entry in self._present(group, hashes):
            if not entry.ready and entry.load_refs == 0:
                self._free(entry)
                self._busy -= 1

    def discard(self, group: int, hashes: Sequence[BlockHash]) -> None:
        """Forget ready blocks found corrupt (unless a load still reads them); slots freed."""
        for block_hash, entry in self._present(group, hashes):
            if entry.ready and entry.load_refs == 0:
                self._free(entry)
                self.evicted[group].append(block_hash)

    def start_promotion(self, group: int, hashes: Sequence[BlockHash]) -> list[int | None]:
        """A pinned slot for each block to bring in from a slower tier; None where none can be had.

        A block the pool already holds, or being saved or brought in, gets
        None, as does every block once every slot is pinned. The slots are
        pinned (`load_refs`) and not ready until `finish_promotion`.
        """
        entries = self._by_group[group]
        slots: list[int | None] = []
        for block_hash in hashes:
            slot = None if block_hash in entries else self._take_slot()
            if slot is not None:
                entry = _Slot(slot, group, block_hash, load_refs=1, clean=True)
                entries[block_hash] = entry
                self._by_slot[slot] = entry
                self._busy += 1
                self._policy.insert(slot, (group, block_hash))
            slots.append(slot)
        return slots

    def join_promotion(self, group: int, hashes: Sequence[BlockHash]) -> list[int | None]:
        """Pin the slot of each block another load is bringing in; None for any other block.

        The joining load reads the block from its slot once it arrived, and
        lets go of it with `finish_promotion` like the load bringing it in.
        """
        entries = self._by_group[group]
        slots: list[int | None] = []
        for block_hash in hashes:
            entry = entries.get(block_hash)
            if entry is None or entry.ready or entry.load_refs == 0:
                slots.append(None)  # not being brought in: absent, ready, or being saved
                continue
            entry.load_refs += 1
            slots.append(entry.slot)
        return slots

    def finish_promotion(
        self, group: int, hashes: Sequence[BlockHash], failed: Sequence[BlockHash]
    ) -> list[BlockHash]:
        """Unpin brought-in blocks; those made ready.

        A block is settled when the last load using it lets go: ready, or
        forgotten (its slot freed) when any of those loads had it `failed`.
        """
        entries = self._by_group[group]
        bad = set(failed)
        ready = []
        for block_hash in hashes:
            entry = entries.get(block_hash)
            if entry is None or entry.ready or entry.load_refs == 0:
                continue
            entry.load_refs -= 1
            entry.failed = entry.failed or block_hash in bad
            if entry.load_refs:
                continue  # a joined load still reads it: the last one settles it
            self._busy -= 1
            if entry.failed:
                self._free(entry)
            else:
                entry.ready = True
                ready.append(block_hash)
        return ready

    def mark_clean(self, group: int, hashes: Sequence[BlockHash]) -> None:
        """The slower tiers hold these blocks: evicting them needs no spill."""
        for _, entry in self._present(group, hashes):
            entry.clean = True

    def take_evicted(self) -> tuple[list[BlockHash], ...]:
        """Per group, the blocks evicted or discarded since the last call, in that order."""
        taken = self.evicted
        self.evicted = tuple([] for _ in taken)
        return taken

    def clear(self) -> bool:
        """Drop every block that no transfer uses; True when the pool is empty after."""
        for entry in list(self._by_slot.values()):
            if entry.ready and entry.load_refs == 0:
                self._free(entry)
                self.evicted[entry.group].append(entry.block_hash)
        return not self._by_slot

    def _touch_tail_first(
        self,
        slots: Sequence[int],
        new_slots: Set[int] = frozenset(),
        continuing: Set[BlockHash] = frozenset(),
    ) -> None:
        """Tell the policy these slots of one request were used, its last block first.

        A block is worth keeping only with every block before it (a lookup
        stops at the first one missing), so the first block of a prefix is
        told last: the most recently used, the last to go. The policy then
        evicts a prefix from its tail, as vLLM's own prefix cache does.
        `new_slots` are inserted rather than hit, those whose block is in
        `continuing` as continuing an earlier prompt.
        """
        for slot in reversed(slots):
            if slot in new_slots:
                entry = self._by_slot[slot]
                if entry.block_hash in continuing:
                    self._policy.insert_continuing(slot, (entry.group, entry.block_hash))
                else:
                    self._policy.insert(slot, (entry.group, entry.block_hash))
            else:
                self._policy.hit(slot)

    def _present(
        self, group: int, hashes: Sequence[BlockHash]
    ) -> Iterator[tuple[BlockHash, _Slot]]:
        """Each of `group`'s blocks in `hashes` that the pool holds (saved, or being saved)."""
        entries = self._by_group[group]
        for block_hash in hashes:
            entry = entries.get(block_hash)
            if entry is not None:
                yield block_hash, entry

    def _free(self, entry: _Slot) -> None:
        """Forget `entry`: its slot leaves the policy and can be taken again."""
        self._remove(entry)
        self._policy.remove(entry.slot)
        self._free_slots.append(entry.slot)

    def _remove(self, entry: _Slot) -> None:
        del self._by_group[entry.group][entry.block_hash]
        del self._by_slot[entry.slot]

    def _evictable(self, slot: int) -> bool:
        entry = self._by_slot[slot]
        return entry.ready and entry.load_refs == 0

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        slot = self._policy.victim(self._evictable)
        if slot is None:
            return None
        entry = self._by_slot[slot]
        self._remove(entry)
        self.evicted[entry.group].append(entry.block_hash)
        if self._on_evict is not None:
            self._on_evict(entry.group, entry.block_hash, slot, entry.clean)
        return slot
