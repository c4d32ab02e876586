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

import itertools
from collections.abc import Callable, Sequence, Set
from typing import NoReturn

from kvwire.interface.types import BlockHash
from kvwire.media.eviction import EvictionPolicy, LRUPolicy


class SlotTable:
    """`num_slots` pool slots, keyed by (group, block hash), evicted in `policy`'s order.

    One dict per group finds an entry's slot by its hash without building a
    key per lookup, and one more per group holds only the ready entries, so
    that a lookup of a prefix runs in C; what else an entry is (being
    loaded, clean, failed) is kept in lists indexed by slot. One policy over
    the slots orders all groups' entries for eviction (an `LRUPolicy` when
    none is given). `on_evict` is called with `(group, block_hash, slot,
    clean)` for each ready block the policy evicts, before its slot is reused.

    A load or a save tells the policy its blocks were used, the request's
    last block first. A block is worth keeping only with every block before
    it (a lookup stops at the first one missing), so the first block of a
    prefix is told last: the most recently used, the last to go. The policy
    then evicts a prefix from its tail, as vLLM's own prefix cache does.
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
        # Per group, every entry's slot by its hash, and the ready entries' alone.
        self._held: tuple[dict[BlockHash, int], ...] = tuple({} for _ in range(num_groups))
        self._ready: tuple[dict[BlockHash, int], ...] = tuple({} for _ in range(num_groups))
        # Per slot: what its entry is (meaningless while the slot is free).
        self._block_of: list[BlockHash] = [b""] * num_slots
        self._group_of = [0] * num_slots
        # Back at 0 and False whenever an entry leaves (no entry a load uses
        # leaves; `_remove` clears `failed`), so a new entry need not set them.
        self._load_refs = [0] * num_slots
        # Being brought in, and a load using it failed: forgotten once no load uses it.
        self._failed = [False] * num_slots
        # The slower tiers hold this block too: evicting it loses nothing.
        self._clean = [False] * num_slots
        # Ready and read by no load: what the policy may evict. Its item getter is
        # the test `victim` is given, a call into C rather than into Python.
        self._evictable = [False] * num_slots
        self._may_evict: Callable[[int], bool] = self._evictable.__getitem__
        # When each entry was made: `clear` goes through them in that order.
        self._made_at = [0] * num_slots
        self._made = itertools.count()
        self._policy = LRUPolicy(num_slots) if policy is None else policy
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._on_evict = on_evict
        # Entries no eviction may take: being saved or brought in, or read by a load.
        self._busy = 0
        # Per group: blocks evicted (or discarded) since the last take_evicted.
        self.evicted: tuple[list[BlockHash], ...] = tuple([] for _ in range(num_groups))

    def __len__(self) -> int:
        return sum(len(held) for held in self._held)

    @property
    def busy(self) -> int:
        """How many slots hold a block being saved or brought in, or read by a load."""
        return self._busy

    def holds(self, group: int, block_hash: BlockHash) -> bool:
        """Whether `group`'s entry for `block_hash` is saved or being saved."""
        return block_hash in self._held[group]

    def holder(self, group: int) -> Callable[[BlockHash], bool]:
        """`holds` for `group`, as a test that runs in C (for a loop over many blocks)."""
        return self._held[group].__contains__

    def arriving(self, group: int, block_hash: BlockHash) -> bool:
        """Whether `group`'s entry for `block_hash` is being brought in (`start_promotion`)."""
        slot = self._held[group].get(block_hash)
        return (
            slot is not None and block_hash not in self._ready[group] and self._load_refs[slot] > 0
        )

    def count_ready_prefix(self, group: int, hashes: Sequence[BlockHash]) -> int:
        """How many of `group`'s `hashes`, from the first, are saved and complete."""
        return len(list(itertools.takewhile(self._ready[group].__contains__, hashes)))

    def start_load(self, group: int, hashes: Sequence[BlockHash]) -> list[int]:
        """Pin ready blocks for a load and mark them recently used; their slots."""
        slots: list[int] | None
        try:
            slots = list(map(self._ready[group].__getitem__, hashes))
        except KeyError:
            slots = None
        if slots is None:
            self._refuse_load(group, hashes)
        load_refs, evictable, hit = self._load_refs, self._evictable, self._policy.hit
        pinned = 0
        # The last block first (see the class's docstring).
        for slot in reversed(slots):
            if evictable[slot]:
                evictable[slot] = False
                pinned += 1
            load_refs[slot] += 1
            hit(slot)
        self._busy += pinned
        return slots

    def finish_load(self, group: int, hashes: Sequence[BlockHash]) -> None:
        held, ready = self._held[group], self._ready[group]
        load_refs, evictable = self._load_refs, self._evictable
        unpinned = 0
        for block_hash in hashes:
            slot = held.get(block_hash)
            if slot is not None and load_refs[slot] > 0:
                load_refs[slot] -= 1
                if load_refs[slot] == 0 and block_hash in ready:
                    evictable[slot] = True
                    unpinned += 1
        self._busy -= unpinned

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
        # The scheduler's hot path: `_place` and `_forget_victim` written out,
        # what the loop reads bound once.
        held, free_slots, victim = self._held[group], self._free_slots, self._policy.victim
        block_of, group_of, clean = self._block_of, self._group_of, self._clean
        made_at, made, may_evict = self._made_at, self._made, self._may_evict
        held_by_group, ready_by_group = self._held, self._ready
        evictable, failed, on_evict = self._evictable, self._failed, self._on_evict
        placed: list[tuple[BlockHash, int]] = []
        touched: list[int] = []
        new_slots: set[int] = set()
        for block_hash in hashes:
            slot = held.get(block_hash)
            if slot is None:
                if free_slots:
                    slot = free_slots.pop()
                else:
                    slot = victim(may_evict)
                    if slot is None:
                        break
                    evicted_group, evicted_hash = group_of[slot], block_of[slot]
                    del held_by_group[evicted_group][evicted_hash]
                    ready_by_group[evicted_group].pop(evicted_hash, None)
                    evictable[slot] = False
                    failed[slot] = False
                    self.evicted[evicted_group].append(evicted_hash)
                    if on_evict is not None:
                        on_evict(evicted_group, evicted_hash, slot, clean[slot])
                held[block_hash] = slot
                block_of[slot] = block_hash
                group_of[slot] = group
                clean[slot] = False
                made_at[slot] = next(made)
                placed.append((block_hash, slot))
                new_slots.add(slot)
            touched.append(slot)
        self._busy += len(placed)
        # The last block first (see the class's docstring); the new ones inserted.
        # A slot comes twice when this save evicted a block it touched, or was
        # given a hash twice: the policy is told of its last entry only, once.
        policy = self._policy
        hit, insert = policy.hit, policy.insert
        told: set[int] = set()
        for slot in reversed(touched):
            if slot in told:
                continue
            told.add(slot)
            if slot in new_slots:
                block_hash = block_of[slot]
                if block_hash in continuing:
                    policy.insert_continuing(slot, (group, block_hash))
                else:
                    insert(slot, (group, block_hash))
            else:
                hit(slot)
        return placed

    def complete_save(self, group: int, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Mark `group`'s saved blocks ready for lookups; those that became ready."""
        held, ready = self._held[group], self._ready[group]
        load_refs, evictable = self._load_refs, self._evictable
        completed = []
        unpinned = 0
        for block_hash in hashes:
            slot = held.get(block_hash)
            if slot is not None and block_hash not in ready:
                ready[block_hash] = slot
                if load_refs[slot] == 0:
                    evictable[slot] = True
                    unpinned += 1
                completed.append(block_hash)
        self._busy -= unpinned
        return completed

    def abandon_save(self, group: int, hashes: Sequence[BlockHash]) -> None:
        """Forget `group`'s blocks whose save failed; their slots become free."""
        held, ready = self._held[group], self._ready[group]
        for block_hash in hashes:
            slot = held.get(block_hash)
            if slot is not None and block_hash not in ready and self._load_refs[slot] == 0:
                self._free(slot)
                self._busy -= 1

    def discard(self, group: int, hashes: Sequence[BlockHash]) -> None:
        """Forget ready blocks found corrupt (unless a load still reads them); slots freed."""
        held = self._held[group]
        for block_hash in hashes:
            slot = held.get(block_hash)
            if slot is not None and self._evictable[slot]:
                self._free(slot)
                self.evicted[group].append(block_hash)

    def start_promotion(self, group: int, hashes: Sequence[BlockHash]) -> list[int | None]:
        """A pinned slot for each block to bring in from a slower tier; None where none can be had.

        A block the pool already holds, or being saved or brought in, gets
        None, as does every block once every slot is pinned. The slots are
        pinned (`load_refs`) and not ready until `finish_promotion`.
        """
        held = self._held[group]
        slots: list[int | None] = []
        for block_hash in hashes:
            slot = None if block_hash in held else self._place(group, block_hash)
            if slot is not None:
                self._load_refs[slot] = 1
                self._clean[slot] = True
                self._policy.insert(slot, (group, block_hash))
            slots.append(slot)
        return slots

    def join_promotion(self, group: int, hashes: Sequence[BlockHash]) -> list[int | None]:
        """Pin the slot of each block another load is bringing in; None for any other block.

        The joining load reads the block from its slot once it arrived, and
        lets go of it with `finish_promotion` like the load bringing it in.
        """
        slots: list[int | None] = []
        for block_hash in hashes:
            if not self.arriving(group, block_hash):
                slots.append(None)  # not being brought in: absent, ready, or being saved
                continue
            slot = self._held[group][block_hash]
            self._load_refs[slot] += 1
            slots.append(slot)
        return slots

    def finish_promotion(
        self, group: int, hashes: Sequence[BlockHash], failed: Sequence[BlockHash]
    ) -> list[BlockHash]:
        """Unpin brought-in blocks; those made ready.

        A block is settled when the last load using it lets go: ready, or
        forgotten (its slot freed) when any of those loads had it `failed`.
        """
        bad = set(failed)
        ready = []
        for block_hash in hashes:
            if not self.arriving(group, block_hash):
                continue
            slot = self._held[group][block_hash]
            self._load_refs[slot] -= 1
            self._failed[slot] = self._failed[slot] or block_hash in bad
            if self._load_refs[slot]:
                continue  # a joined load still reads it: the last one settles it
            self._busy -= 1
            if self._failed[slot]:
                self._free(slot)
            else:
                self._ready[group][block_hash] = slot
                self._evictable[slot] = True
                ready.append(block_hash)
        return ready

    def mark_clean(self, group: int, hashes: Sequence[BlockHash]) -> None:
        """The slower tiers hold these blocks: evicting them needs no spill."""
        held = self._held[group]
        for block_hash in hashes:
            slot = held.get(block_hash)
            if slot is not None:
                self._clean[slot] = True

    def take_evicted(self) -> tuple[list[BlockHash], ...]:
        """Per group, the blocks evicted or discarded since the last call, in that order."""
        taken = self.evicted
        self.evicted = tuple([] for _ in taken)
        return taken

    def forget_evicted(self) -> int:
        """Forget the blocks `take_evicted` would take (a caller that needs no list); how many."""
        count = 0
        for evicted in self.evicted:
            count += len(evicted)
            evicted.clear()
        return count

    def clear(self) -> bool:
        """Drop every block that no transfer uses; True when the pool is empty after."""
        slots = [slot for held in self._held for slot in held.values()]
        for slot in sorted(slots, key=self._made_at.__getitem__):
            if self._evictable[slot]:
                group, block_hash = self._group_of[slot], self._block_of[slot]
                self._free(slot)
                self.evicted[group].append(block_hash)
        return not any(self._held)

    def _refuse_load(self, group: int, hashes: Sequence[BlockHash]) -> NoReturn:
        """Pin the blocks before the first one not ready, then raise the KeyError that names it.

        An absent block raises the dict's own KeyError (its hash), one still
        being saved or brought in says so.
        """
        ready = self._ready[group]
        for block_hash in hashes:
            slot = self._held[group][block_hash]
            if block_hash not in ready:
                raise KeyError(
                    f"block {block_hash.hex()[:16]} of group {group} is not ready in the CPU pool"
                )
            if self._evictable[slot]:
                self._evictable[slot] = False
                self._busy += 1
            self._load_refs[slot] += 1
        raise AssertionError("_refuse_load is called only when a block is not ready")

    def _place(self, group: int, block_hash: BlockHash) -> int | None:
        """A slot for `group`'s `block_hash`, not ready: being saved or brought in.

        A free slot, else the policy's victim, evicted; None when every slot is pinned.
        """
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = self._policy.victim(self._may_evict)
            if victim is None:
                return None
            slot = victim
            self._forget_victim(slot)
        self._held[group][block_hash] = slot
        self._block_of[slot] = block_hash
        self._group_of[slot] = group
        self._clean[slot] = False
        self._made_at[slot] = next(self._made)
        self._busy += 1
        return slot

    def _forget_victim(self, slot: int) -> None:
        """The policy evicted `slot`'s entry: forget it, and tell `on_evict`."""
        group, block_hash = self._group_of[slot], self._block_of[slot]
        self._remove(slot)
        self.evicted[group].append(block_hash)
        if self._on_evict is not None:
            self._on_evict(group, block_hash, slot, self._clean[slot])

    def _free(self, slot: int) -> None:
        """Forget `slot`'s entry: the slot leaves the policy and can be taken again."""
        self._remove(slot)
        self._policy.remove(slot)
        self._free_slots.append(slot)

    def _remove(self, slot: int) -> None:
        group, block_hash = self._group_of[slot], self._block_of[slot]
        del self._held[group][block_hash]
        self._ready[group].pop(block_hash, None)
        self._evictable[slot] = False
        self._failed[slot] = False
