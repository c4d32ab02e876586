"""The CPU pool medium's scheduler half: the pool's index behind the MediumIndex calls.

`SlotTable` decides which slot holds
which block; this half adds what the offload connector expects of a medium:
the KV cache events (one per KV cache group that changed, in the order the
changes happened), the admission of saves (`SaveAdmission`: a block is saved
once offered `save_threshold` times) and the counts of blocks evicted, of
saves the pool had no room for and of saves not admitted. For an eviction
policy that takes the hint (`EvictionPolicy.insert_continuing`), it also
tells which new blocks continue a prompt that an earlier prompt ended at. A tiered medium's
index (`kvwire.media.tiered.index.TieredIndex`) keeps one as its pool and
uses it through its public calls: those of any index, and the promotions of
blocks brought in from slower tiers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence, Set

from kvwire.blocks.transfers import TransferPayload
from kvwire.interface.types import BlockHash, BlockRemoved, BlockStored, KVCacheEvent
from kvwire.media.admission import SaveAdmission
from kvwire.media.base import LoadSpec, MediumIndex
from kvwire.media.cpu_pool._slot_table import SlotTable
from kvwire.media.eviction import EvictionPolicy


class CPUPoolIndex(MediumIndex):
    """The pool's index over `num_slots` slots shared by `num_groups` KV cache groups.

    `medium` names the pool in the KV cache events; `policy` orders its
    evictions (least recently used when None); `admission` decides which
    blocks offered for a save are saved (every one when None); `on_evict`
    is told of each ready block the policy evicts (see `SlotTable`). With
    `keep_events` False, no KV cache event is kept (`take_events` answers
    none): for a caller that drops them, such as a replay of a trace.
    """

    def __init__(
        self,
        num_slots: int,
        num_groups: int,
        medium: str,
        *,
        policy: EvictionPolicy | None = None,
        admission: SaveAdmission | None = None,
        on_evict: Callable[[int, BlockHash, int, bool], None] | None = None,
        keep_events: bool = True,
    ) -> None:
        self._index = SlotTable(num_slots, num_groups, policy, on_evict)
        self._keep_events = keep_events
        self._admission = admission
        self._prompts = (
            _Prompts(num_slots, num_groups)
            if policy is not None
            and type(policy).insert_continuing is not EvictionPolicy.insert_continuing
            else None
        )
        self._medium = medium
        self._events: list[KVCacheEvent] = []
        self._counters: dict[str, int] = {}

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """Blocks being saved count only once their save completed."""
        held = self._index.count_ready_prefix(group, block_hashes)
        if self._prompts is not None:
            self._prompts.looked_up(group, block_hashes, held)
        return held

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> LoadSpec:
        """Pin the blocks (no eviction until `complete_load`); their slots, in order."""
        ready = self._index.count_ready_prefix(group, block_hashes)
        if ready < len(block_hashes):
            # Checked before pinning anything, so a refused load pins nothing.
            raise ValueError(
                f"prepare_load: the CPU pool holds {ready} of the {len(block_hashes)} blocks "
                f"asked for in KV cache group {group} (block {block_hashes[ready].hex()[:16]} "
                "is missing or still being saved); a load is prepared only for blocks "
                "count_held_prefix just counted"
            )
        return LoadSpec(slots=tuple(self._index.start_load(group, block_hashes)))

    def complete_load(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        corrupt: Sequence[BlockHash],
        payload: TransferPayload | None = None,
    ) -> None:
        """Unpin the blocks; a corrupt one would fail every later load, so it is forgotten."""
        self._index.finish_load(group, block_hashes)
        if corrupt:
            self._index.discard(group, corrupt)
            # Removed from the pool, yet not an eviction: not counted as one.
            self._record_evictions()

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        """A slot for each admitted block the pool lacks, evicting as the policy says.

        Blocks the pool holds (or is saving) are not copied again. The blocks
        from the first one admission refuses on are not saved, and count as
        `saves_not_admitted`: without that block a lookup stops there, so the
        blocks after it would be found by none. Blocks left out otherwise
        found every slot pinned, and count as `stores_skipped_pool_full`.
        Either way they are absent from the answer: the connector saves only
        the blocks given a slot.
        """
        admitted = self._admitted(group, block_hashes)
        continuing: Set[BlockHash] = (
            self._prompts.continuing[group].keys() if self._prompts is not None else frozenset()
        )
        placed = self._index.prepare_save(group, admitted, continuing)
        if len(placed) < len(admitted):
            # A placed block is being saved, so no eviction took it: every block
            # the pool does not hold now is one it had no room for.
            held = sum(map(self._index.holder(group), admitted))
            self._count("stores_skipped_pool_full", len(admitted) - held)
        self._count("evicted_blocks", self._record_evictions())
        return list(placed)

    def complete_save(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        """Made: the blocks become hits (a stored event). Not made: their slots are freed."""
        if not success:
            self._index.abandon_save(group, block_hashes)
            return
        completed = self._index.complete_save(group, block_hashes)
        if completed and self._keep_events:
            self._events.append(
                BlockStored(block_hashes=tuple(completed), medium=self._medium, group=group)
            )

    # ------------------------------------------- a tiered medium's pool (kvwire.media.tiered)

    @property
    def num_slots(self) -> int:
        """How many slots the pool has."""
        return self._index.num_slots

    @property
    def busy_slots(self) -> int:
        """How many slots hold a block being saved or brought in, or read by a load."""
        return self._index.busy

    def holds(self, group: int, block_hash: BlockHash) -> bool:
        """Whether the pool holds `group`'s block, ready or not (being saved or brought in)."""
        return self._index.holds(group, block_hash)

    def ready(self, group: int, block_hash: BlockHash) -> bool:
        """Whether the pool holds `group`'s block saved and complete: a load may read it.

        Unlike `count_held_prefix`, not a lookup of a prompt: no policy is told of it.
        """
        return self._index.count_ready_prefix(group, (block_hash,)) == 1

    def arriving(self, group: int, block_hash: BlockHash) -> bool:
        """Whether `group`'s block is being brought in from a slower tier (`start_promotion`)."""
        return self._index.arriving(group, block_hash)

    def start_promotion(self, group: int, block_hashes: Sequence[BlockHash]) -> list[int | None]:
        """A pinned slot for each block to bring in from a slower tier; None where none is free.

        See `SlotTable.start_promotion`; `finish_promotion` lets go of them. The
        blocks evicted to make room are reported and counted (`evicted_blocks`), as
        a save's are.
        """
        slots = self._index.start_promotion(group, block_hashes)
        self._count("evicted_blocks", self._record_evictions())
        return slots

    def join_promotion(self, group: int, block_hashes: Sequence[BlockHash]) -> list[int | None]:
        """Share the slots of blocks another load brings in; None for a block no load does."""
        return self._index.join_promotion(group, block_hashes)

    def finish_promotion(
        self, group: int, block_hashes: Sequence[BlockHash], failed: Sequence[BlockHash]
    ) -> list[BlockHash]:
        """A load that brought in (or shared) these blocks ended; those that became hits.

        They get a stored event (see `SlotTable.finish_promotion` for those that failed).
        """
        ready = self._index.finish_promotion(group, block_hashes, failed)
        if ready and self._keep_events:
            self._events.append(
                BlockStored(block_hashes=tuple(ready), medium=self._medium, group=group)
            )
        return ready

    def mark_clean(self, group: int, block_hashes: Sequence[BlockHash]) -> None:
        """Slower tiers hold these blocks too: evicting them loses nothing (no `on_evict` spill)."""
        self._index.mark_clean(group, block_hashes)

    def record_evictions(self) -> None:
        """Report the blocks removed since the last report (removed events), not counted.

        A tiered medium calls it once a load ended: the blocks of its promotions
        that failed were forgotten, which is not an eviction.
        """
        self._record_evictions()

    # ------------------------------------------------------------- reporting

    def take_events(self) -> list[KVCacheEvent]:
        """Blocks removed (evicted, discarded, cleared) and stored, in the order it happened."""
        events, self._events = self._events, []
        return events

    def take_counters(self) -> Mapping[str, int]:
        """`evicted_blocks`, `stores_skipped_pool_full`, `saves_not_admitted` since the last call.

        Only those not 0.
        """
        counters, self._counters = self._counters, {}
        return counters

    def reset(self) -> bool:
        """Forget every block no transfer uses; True when the pool is empty after."""
        emptied = self._index.clear()
        self._record_evictions()
        return emptied

    def _admitted(self, group: int, block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """`block_hashes` up to the first block admission refuses; every new one is counted seen."""
        if self._admission is None:
            return block_hashes
        holds, admit = self._index.holder(group), self._admission.admit
        refused_at: int | None = None
        not_admitted = 0
        for position, block_hash in enumerate(block_hashes):
            if holds(block_hash):
                continue
            if not admit(block_hash, group) and refused_at is None:
                refused_at = position
            if refused_at is not None:
                not_admitted += 1
        if refused_at is None:
            return block_hashes
        self._count("saves_not_admitted", not_admitted)
        return block_hashes[:refused_at]

    def _count(self, name: str, amount: int) -> None:
        if amount:
            self._counters[name] = self._counters.get(name, 0) + amount

    def _record_evictions(self) -> int:
        """A removed event per group whose blocks left the pool since the last call; how many."""
        if not self._keep_events:
            return self._index.forget_evicted()
        if not any(self._index.evicted):
            return 0
        count = 0
        for group, evicted in enumerate(self._index.take_evicted()):
            if evicted:
                self._events.append(
                    BlockRemoved(block_hashes=tuple(evicted), medium=self._medium, group=group)
                )
                count += len(evicted)
        return count


class _Prompts:
    """Where looked-up prompts ended, and the blocks of prompts that grow one: bounded.

    A prompt whose held prefix ends at the last block of an earlier prompt
    grows it (a conversation's next turn, an agent's next step): its blocks
    after the held prefix are `continuing` until saved or forgotten. Each
    group remembers at most `limit` ends and `limit` continuing blocks, the
    oldest forgotten first: memory of the pool's order, O(1) per block looked up.
    Lookups may run on a lookup thread beside the scheduler's (a tiered
    medium's): they change these under a lock.
    """

    def __init__(self, limit: int, num_groups: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._ends: tuple[OrderedDict[BlockHash, None], ...] = tuple(
            OrderedDict() for _ in range(num_groups)
        )
        self.continuing: tuple[OrderedDict[BlockHash, None], ...] = tuple(
            OrderedDict() for _ in range(num_groups)
        )

    def looked_up(self, group: int, block_hashes: Sequence[BlockHash], held: int) -> None:
        if not block_hashes:
            return
        ends, continuing = self._ends[group], self.continuing[group]
        with self._lock:
            if 0 < held < len(block_hashes) and block_hashes[held - 1] in ends:
                for block_hash in block_hashes[held:]:
                    continuing[block_hash] = None
                while len(continuing) > self._limit:
                    continuing.popitem(last=False)
            # The newest end goes last, forgotten last.
            ends.pop(block_hashes[-1], None)
            ends[block_hashes[-1]] = None
            while len(ends) > self._limit:
                ends.popitem(last=False)
