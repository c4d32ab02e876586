"""The tiered medium's scheduler half: the pool's slot table, and where each block comes from.

A lookup counts the blocks the pool holds, then asks each secondary tier in
turn for the blocks after them, and remembers which tier held each block
(by group and hash, for a bounded number of blocks: requests that share a
prefix share these records, whatever order their lookups and loads come
in). When the load is prepared, each block is taken where it is now: the
pool's ready blocks are pinned as a CPU pool load pins them; a block another
load is bringing in is shared with it (`SlotTable.join_promotion`: a lookup
made before that load was prepared counted it, as `async_lookup` does); a
block found in a tier gets a pool slot, pinned and not ready
(`SlotTable.start_promotion`): the worker reads it from its tier into that
slot, then copies the slots into the cache. Each block's `sources` tell the
worker where it is: `""` in the pool, `"<N>:<tier's own source>"` in tier
`N`, `"~"` arriving in the pool with another load (read once it arrived),
`"-"` nowhere any more (it left the pool between the lookup and the load,
or the pool had no free slot to bring it into): a load error, which the
engine computes again (counted in `load_blocks_missing`). A lookup counts
no more blocks from the tiers than the pool has slots to bring them into,
so that this stays rare.

Which blocks reach the secondary tiers: with `write_through`, every block
whose pool save is made; with `spill`, each ready block the pool evicts
while no tier holds it yet (`take_spills`, which the worker writes from its
slot before that slot is written again). A tier found by key
(`Medium.found_by_key`: shared storage, Redis) is written by the worker on
its own (a write-through once the pool save job ended). A tier that places
its blocks (the peer medium, whose index gives each block a slot of its pool
and announces it in its directory) is written where its `prepare_save`
says: with `write_through`, as part of the pool's save (the places travel
as the save's sources, `save_sources`), published by the save's
`complete_save`; with `spill`, as a *named* spill (`tier_write_name`),
published once every worker of the engine reported it ended
(`complete_spills`). Such a tier's loads must pin nothing: it finds its
blocks by key or by its `load_sources`.

Lookups may run on a lookup thread (`concurrent_lookups`): the pool's
count only reads the slot table (a stale answer is caught when the load is
prepared), and a tier whose own index does not allow it is left out of a
lookup made off the scheduler's thread.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import ClassVar

import attrs

from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.types import BlockHash, BlockStored, KVCacheEvent
from kvwire.media.admission import SaveAdmission
from kvwire.media.base import MediumIndex
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.eviction import EvictionPolicy
from kvwire.media.rate_limited import RateLimitedWarning
from kvwire.redaction import SHOWN_LENGTH, redact_text, shown

__all__ = [
    "ARRIVING",
    "MISSING",
    "TieredIndex",
    "places_source",
    "source_places",
    "tier_of_write",
    "tier_prefix",
    "tier_source",
    "tier_write_name",
]

logger = logging.getLogger(__name__)

MISSING = "-"
"""The source of a block to load that no tier can give any more: the worker fails it."""

ARRIVING = "~"
"""The source of a block another load of the same step or an earlier one brings into its slot."""

# Blocks whose tier a lookup found, kept for their loads: far more than one step admits.
_MAX_FOUND_BLOCKS = 65536
# Writes to placing tiers awaiting every worker's report: far more than the
# tiers' own limits on writes in flight let run at once.
_MAX_PLACED_WRITES = 65536
# The lookup-delay buckets reported per tier, in seconds, with their counter names.
_DELAY_BUCKETS = ((0.001, "lookups_le_1ms"), (0.01, "lookups_le_10ms"), (0.1, "lookups_le_100ms"))


def tier_prefix(number: int) -> str:
    """The prefix of secondary tier `number`'s counters (`tier1.`)."""
    return f"tier{number}."


def tier_source(number: int, source: str) -> str:
    """A load's source for a block in secondary tier `number`, where its tier found it."""
    return f"{number}:{source}"


def places_source(places: Mapping[int, int]) -> str:
    """A save's source for a block placing tiers take too: `"<tier>@<place>"` each, by commas."""
    return ",".join(f"{number}@{place}" for number, place in sorted(places.items()))


def source_places(source: str) -> dict[int, int]:
    """The placing tiers' places a save's source names (`places_source`); {} for none."""
    places: dict[int, int] = {}
    for item in filter(None, source.split(",")):
        number, at, place = item.partition("@")
        if at and number.isdigit() and place.isdigit():
            places[int(number)] = int(place)
    return places


def tier_write_name(number: int, serial: int) -> str:
    """The name of a write to placing tier `number` (a named spill's `request_id`)."""
    return f"tier{number}/{serial}"


def tier_of_write(name: str) -> int | None:
    """The tier a named spill writes (`tier_write_name`); None for a spill to every tier by key."""
    head, slash, serial = name.partition("/")
    number = head.removeprefix("tier")
    if not (slash and head.startswith("tier") and number.isdigit() and serial.isdigit()):
        return None
    return int(number)


@attrs.define
class _PlacedWrite:
    """A write to a placing tier, until every worker reported it ended."""

    tier: int
    group: int
    block_hashes: tuple[BlockHash, ...]
    reports: int = 0
    written: bool = True


class _Place(enum.Enum):
    """Where a block to load is when its load is prepared."""

    POOL = enum.auto()
    """Ready in the pool."""
    ARRIVING = enum.auto()
    """Being brought into the pool by another load: shared with it."""
    TIER = enum.auto()
    """In a secondary tier: brought in by this load."""
    MISSING = enum.auto()
    """Nowhere a load can read it from any more."""


@attrs.define
class _Load:
    """One prepared load: each block's tier (0: the pool; None: missing).

    `joined` holds the positions of blocks another load brings in from the
    tier named at that position: this load only shares their slots.
    """

    tiers: list[int | None]
    joined: frozenset[int] = frozenset()


class TieredIndex(CPUPoolIndex):
    """The pool's index with secondary tiers' indexes behind it (see the module)."""

    concurrent_lookups: ClassVar[bool] = True

    def __init__(
        self,
        num_slots: int,
        num_groups: int,
        medium: str,
        *,
        tiers: Sequence[MediumIndex],
        write_through: bool,
        policy: EvictionPolicy | None = None,
        admission: SaveAdmission | None = None,
        found_by_key: Sequence[bool] = (),
        ranks: int = 1,
    ) -> None:
        super().__init__(
            num_slots,
            num_groups,
            medium,
            policy=policy,
            admission=admission,
            on_evict=self._evicted,
        )
        if not tiers:
            raise ValueError("TieredIndex: expected at least one secondary tier's index")
        by_key = tuple(found_by_key) or (True,) * len(tiers)
        if len(by_key) != len(tiers):
            raise ValueError(
                f"TieredIndex: found_by_key has {len(by_key)} flags for {len(tiers)} tiers"
            )
        if ranks < 1:
            raise ValueError(f"TieredIndex: ranks must be >= 1, got {ranks}")
        self._num_slots = num_slots
        self._tiers = tuple(tiers)
        self._write_through = write_through
        self._any_by_key = any(by_key)
        # The tiers written where their index places each block, by number.
        self._placing = tuple(number for number, key in enumerate(by_key, 1) if not key)
        self._ranks = ranks
        # Blocks being saved to the pool and, with write-through, to placing
        # tiers: (group, hash) -> {tier number: the tier's place}.
        self._through_places: dict[tuple[int, BlockHash], dict[int, int]] = {}
        self._placed_writes: dict[str, _PlacedWrite] = {}
        self._write_serials = itertools.count()
        self._scheduler_thread = threading.get_ident()
        self._warn = RateLimitedWarning(logger)
        # Written by lookup threads too: every change of these under the lock.
        self._lock = threading.Lock()
        # Which tier a lookup found each block in, by (group, hash); oldest dropped first.
        self._found_in: dict[tuple[int, BlockHash], int] = {}
        # Blocks being brought in, by (group, hash): the tier each comes from.
        self._arriving_from: dict[tuple[int, BlockHash], int] = {}
        self._tier_counts: dict[str, int] = {}
        # Prepared loads not completed yet, by (group, first block, length): two
        # loads of the same blocks complete in the order they were prepared.
        self._loads: dict[tuple[int, BlockHash, int], list[_Load]] = {}
        self._sources: dict[tuple[int, BlockHash, int], tuple[str, ...]] = {}
        self._spills: list[tuple[int, BlockHash, int]] = []

    # --------------------------------------------------------------- lookups

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """The pool's ready prefix, extended by each secondary tier in turn."""
        held = self._index.count_ready_prefix(group, block_hashes)
        # Blocks from the tiers each need a slot the load can take: no more than
        # are neither busy nor this load's own (a block promised and then given
        # no slot would be a load error, which costs vLLM a rescheduled request).
        end = min(len(block_hashes), held + max(0, self._num_slots - self._index.busy - held))
        # A block the pool holds but cannot give yet (still being saved, or brought in
        # by another load) can take no slot to be brought in: the prefix ends there.
        end = next((i for i in range(held, end) if self._index.holds(group, block_hashes[i])), end)
        on_scheduler_thread = threading.get_ident() == self._scheduler_thread
        for number, tier in enumerate(self._tiers, 1):
            if held >= end:
                break
            if not (on_scheduler_thread or tier.concurrent_lookups):
                continue
            found = self._count_in_tier(number, tier, group, block_hashes[held:end])
            if found:
                self._record_found(number, group, block_hashes[held : held + found])
                held += found
        return held

    def _record_found(self, number: int, group: int, block_hashes: Sequence[BlockHash]) -> None:
        """Remember that tier `number` holds these blocks, for their loads."""
        with self._lock:
            for block_hash in block_hashes:
                key = (group, block_hash)
                self._found_in.pop(key, None)  # the newest answer goes last, dropped last
                self._found_in[key] = number
            while len(self._found_in) > _MAX_FOUND_BLOCKS:
                del self._found_in[next(iter(self._found_in))]

    def _count_in_tier(
        self, number: int, tier: MediumIndex, group: int, block_hashes: Sequence[BlockHash]
    ) -> int:
        """Tier `number`'s count, timed; an error or an answer that is no count is a miss."""
        started = time.perf_counter()
        try:
            found = tier.count_held_prefix(group, block_hashes)
        except Exception as error:
            self._warn.warn(
                f"tier{number}-count-raised",
                "tier %d: looking up %d blocks raised %s: %s; counted as a miss",
                number,
                len(block_hashes),
                type(error).__name__,
                redact_text(str(error))[:SHOWN_LENGTH],
            )
            found = 0
        elapsed = time.perf_counter() - started
        if not (
            isinstance(found, int)
            and not isinstance(found, bool)
            and 0 <= found <= len(block_hashes)
        ):
            self._warn.warn(
                f"tier{number}-count-invalid",
                "tier %d: looking up %d blocks answered %s; counted as a miss",
                number,
                len(block_hashes),
                shown(found),
            )
            found = 0
        prefix = tier_prefix(number)
        counts = {f"{prefix}lookups": 1, f"{prefix}lookup_microseconds": round(elapsed * 1e6)}
        for bound, name in _DELAY_BUCKETS:
            if elapsed <= bound:
                counts[prefix + name] = 1
        with self._lock:
            for name, amount in counts.items():
                self._tier_counts[name] = self._tier_counts.get(name, 0) + amount
        return found

    # ----------------------------------------------------------------- loads

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """Take each block where it is now (see the module); every block's slot.

        A block no tier can give any more gets an out-of-range slot and the
        source `MISSING`: the worker fails it without reading anything.
        """
        if not block_hashes:
            return ()
        with self._lock:
            found = [self._found_in.get((group, block_hash)) for block_hash in block_hashes]
        where = [self._where(group, h, tier) for h, tier in zip(block_hashes, found, strict=True)]
        slots: list[int] = []
        tiers: list[int | None] = []
        sources: list[str] = []
        joined: set[int] = set()
        position = 0
        while position < len(block_hashes):
            end = position + 1
            while end < len(block_hashes) and where[end] == where[position]:
                end += 1
            span = block_hashes[position:end]
            place, number = where[position]
            if place is _Place.POOL:
                slots += self._index.start_load(group, span)
                tiers += [0] * len(span)
                sources += [""] * len(span)
            elif place is _Place.ARRIVING:
                shared = self._index.join_promotion(group, span)
                for offset, slot in enumerate(shared):
                    if slot is None:
                        self._missing(slots, tiers, sources)
                    else:
                        slots.append(slot)
                        tiers.append(number)
                        sources.append(ARRIVING)
                        joined.add(position + offset)
            elif place is _Place.TIER:
                self._bring_in(number, group, span, slots, tiers, sources)
            else:
                for _ in span:
                    self._missing(slots, tiers, sources)
            position = end
        key = (group, block_hashes[0], len(block_hashes))
        self._loads.setdefault(key, []).append(_Load(tiers, frozenset(joined)))
        self._sources[key] = tuple(sources)
        return tuple(slots)

    def _where(self, group: int, block_hash: BlockHash, found_in: int | None) -> tuple[_Place, int]:
        """Where a block to load is now, and the tier it comes from (0: the pool or none)."""
        if self._index.count_ready_prefix(group, (block_hash,)):
            return _Place.POOL, 0
        arriving_from = self._arriving_from.get((group, block_hash))
        if arriving_from is not None and self._index.arriving(group, block_hash):
            return _Place.ARRIVING, arriving_from
        if found_in is not None and not self._index.holds(group, block_hash):
            return _Place.TIER, found_in
        # Left the pool since the lookup, or still being saved: nowhere to read it from.
        return _Place.MISSING, 0

    def _bring_in(
        self,
        number: int,
        group: int,
        span: Sequence[BlockHash],
        slots: list[int],
        tiers: list[int | None],
        sources: list[str],
    ) -> None:
        """Slots for `span`, found in tier `number`; a block with none is missing."""
        tier = self._tiers[number - 1]
        taken = self._index.start_promotion(group, span)
        found_at = self._tier_sources(number, tier, group, span)
        if found_at is None:
            self._index.finish_promotion(
                group, [h for h, slot in zip(span, taken, strict=True) if slot is not None], span
            )
            taken = [None] * len(span)
            found_at = ("",) * len(span)
        for block_hash, slot, source in zip(span, taken, found_at, strict=True):
            if slot is None:
                self._missing(slots, tiers, sources)
            else:
                self._arriving_from[(group, block_hash)] = number
                slots.append(slot)
                tiers.append(number)
                sources.append(tier_source(number, source))

    def _missing(self, slots: list[int], tiers: list[int | None], sources: list[str]) -> None:
        """A block of the load no tier can give: an out-of-range slot the worker never reads."""
        slots.append(self._num_slots)
        tiers.append(None)
        sources.append(MISSING)
        self._count("load_blocks_missing", 1)

    def _tier_sources(
        self, number: int, tier: MediumIndex, group: int, span: Sequence[BlockHash]
    ) -> Sequence[str] | None:
        """Tier `number`'s load prepared: where it says each block is; None when it cannot load."""
        try:
            pinned = tier.prepare_load(group, span)
            if not pinned:
                return tier.load_sources(group, span) or ("",) * len(span)
            tier.complete_load(group, span, ())
        except Exception as error:
            self._warn.warn(
                f"tier{number}-prepare-raised",
                "tier %d: preparing a load of %d blocks raised %s; computed again",
                number,
                len(span),
                type(error).__name__,
            )
            return None
        self._warn.warn(
            f"tier{number}-prepare-pinned",
            "tier %d: its index pinned slots for a load (prepare_load), which a secondary "
            "tier's load cannot use: it must find its blocks by key or by its load_sources; "
            "%d blocks computed again",
            number,
            len(span),
        )
        return None

    def load_sources(self, group: int, block_hashes: Sequence[BlockHash]) -> tuple[str, ...]:
        """Where each block of the load just prepared is (see the module)."""
        if not block_hashes:
            return ()
        return self._sources.pop((group, block_hashes[0], len(block_hashes)), ())

    def complete_load(
        self, group: int, block_hashes: Sequence[BlockHash], corrupt: Sequence[BlockHash]
    ) -> None:
        """Unpin the pool's blocks; the blocks brought in become hits, unless they failed."""
        if not block_hashes:
            return
        key = (group, block_hashes[0], len(block_hashes))
        loads = self._loads.get(key)
        if not loads:
            super().complete_load(group, block_hashes, corrupt)
            return
        load = loads.pop(0)
        if not loads:
            del self._loads[key]
        self._sources.pop(key, None)
        in_pool = [h for h, tier in zip(block_hashes, load.tiers, strict=True) if tier == 0]
        bad = set(corrupt)
        super().complete_load(group, in_pool, [h for h in in_pool if h in bad])
        for number, tier in enumerate(self._tiers, 1):
            positions = [i for i, where in enumerate(load.tiers) if where == number]
            if not positions:
                continue
            arriving = [block_hashes[i] for i in positions]
            ready = self._index.finish_promotion(group, arriving, [h for h in arriving if h in bad])
            if ready:
                self._events.append(
                    BlockStored(block_hashes=tuple(ready), medium=self._medium, group=group)
                )
                self._count(tier_prefix(number) + "promoted_blocks", len(ready))
            for block_hash in arriving:
                if not self._index.arriving(group, block_hash):
                    self._arriving_from.pop((group, block_hash), None)
            brought = [block_hashes[i] for i in positions if i not in load.joined]
            if brought:
                # The tier's handler judged its own entries as it read them.
                tier.complete_load(group, brought, ())
        self._record_evictions()

    # ----------------------------------------------------------------- saves

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        """The pool's places; with `write_through`, each placing tier places the blocks too."""
        placed = super().prepare_save(group, block_hashes)
        if not (placed and self._write_through and self._placing):
            return placed
        hashes = [block_hash for block_hash, _ in placed]
        for number in self._placing:
            for block_hash, place in self._tier_places(number, group, hashes).items():
                self._through_places.setdefault((group, block_hash), {})[number] = place
        return placed

    def save_sources(self, group: int, block_hashes: Sequence[BlockHash]) -> tuple[str, ...]:
        """Where each block of the save just placed goes in the placing tiers (`places_source`)."""
        if not self._through_places:
            return ()
        sources = tuple(
            places_source(self._through_places.get((group, block_hash), {}))
            for block_hash in block_hashes
        )
        return sources if any(sources) else ()

    def complete_save(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        """As the pool's; with `write_through`, each tier holds the blocks too.

        Tiers found by key were written by the worker once the save job
        ended; a placing tier was written as part of the save (the worker
        reports the save ended once its tier writes did) and publishes them
        now, or frees their places.
        """
        super().complete_save(group, block_hashes, success=success)
        if success and self._write_through:
            self._index.mark_clean(group, block_hashes)
        if not self._through_places:
            return
        by_tier: dict[int, list[BlockHash]] = {}
        for block_hash in block_hashes:
            for number in self._through_places.pop((group, block_hash), {}):
                by_tier.setdefault(number, []).append(block_hash)
        for number, hashes in by_tier.items():
            self._settle(number, group, hashes, written=success)

    def _evicted(self, group: int, block_hash: BlockHash, slot: int, clean: bool) -> None:
        if not clean and not self._write_through:
            self._spills.append((group, block_hash, slot))

    def take_spills(self) -> list[BlockTransfer]:
        """The blocks evicted that no tier holds since the last call; block ids are pool slots.

        To the tiers found by key: one transfer per group, unnamed. To each
        placing tier: one named transfer per group, its `slots` where the
        tier's `prepare_save` placed them.
        """
        if not self._spills:
            return []
        spills, self._spills = self._spills, []
        transfers: list[BlockTransfer] = []
        if spills and self._any_by_key:
            transfers += [
                BlockTransfer(
                    request_id="",
                    group=group,
                    block_ids=slots,
                    block_hashes=hashes,
                    slots=slots,
                )
                for group, hashes, slots in _by_group(spills)
            ]
        if self._placing:
            for group, hashes, slots in _by_group(spills):
                for number in self._placing:
                    transfer = self._place_write(number, group, hashes, slots)
                    if transfer is not None:
                        transfers.append(transfer)
        return transfers

    def _place_write(
        self,
        number: int,
        group: int,
        hashes: tuple[BlockHash, ...],
        pool_slots: tuple[int, ...],
    ) -> BlockTransfer | None:
        """A named write of these pool blocks to placing tier `number`, where it places them."""
        placed = self._tier_places(number, group, hashes)
        positions = [i for i, block_hash in enumerate(hashes) if block_hash in placed]
        if not positions:
            return None
        taken = tuple(hashes[i] for i in positions)
        if len(self._placed_writes) >= _MAX_PLACED_WRITES:
            # A worker that never reports (it died): its oldest writes count as not made.
            oldest = next(iter(self._placed_writes))
            stale = self._placed_writes.pop(oldest)
            self._settle(stale.tier, stale.group, stale.block_hashes, written=False)
        name = tier_write_name(number, next(self._write_serials))
        self._placed_writes[name] = _PlacedWrite(number, group, taken)
        return BlockTransfer(
            request_id=name,
            group=group,
            block_ids=tuple(pool_slots[i] for i in positions),
            block_hashes=taken,
            slots=tuple(placed[block_hash] for block_hash in taken),
        )

    def _tier_places(
        self, number: int, group: int, hashes: Sequence[BlockHash]
    ) -> dict[BlockHash, int]:
        """Where placing tier `number` places these blocks (those it takes).

        A block it takes without a slot is given back (not saved): a placing
        tier's worker writes a block only where its index said.
        """
        tier = self._tiers[number - 1]
        try:
            placed = tier.prepare_save(group, hashes)
        except Exception as error:
            self._warn.warn(
                f"tier{number}-prepare-save-raised",
                "tier %d: placing %d blocks raised %s; not written to it",
                number,
                len(hashes),
                type(error).__name__,
            )
            return {}
        places = {
            h: place
            for h, place in placed
            if isinstance(place, int) and not isinstance(place, bool) and place >= 0
        }
        unplaced = [h for h, place in placed if h not in places]
        if unplaced:
            self._warn.warn(
                f"tier{number}-prepare-save-unplaced",
                "tier %d: prepare_save gave no slot to %d blocks; not written to it",
                number,
                len(unplaced),
            )
            self._settle(number, group, unplaced, written=False)
        return places

    def complete_spills(self, ended: Sequence[tuple[str, bool]]) -> None:
        """Count the workers' reports of named writes; settle a write once every worker's came."""
        for name, written in ended:
            write = self._placed_writes.get(name)
            if write is None:
                continue
            write.reports += 1
            write.written = write.written and bool(written)
            if write.reports >= self._ranks:
                del self._placed_writes[name]
                self._settle(write.tier, write.group, write.block_hashes, written=write.written)

    def _settle(
        self, number: int, group: int, hashes: Sequence[BlockHash], *, written: bool
    ) -> None:
        """Tell placing tier `number` its write ended: made (it publishes them) or not."""
        if not written:
            self._count(tier_prefix(number) + "writes_not_made", len(hashes))
        try:
            self._tiers[number - 1].complete_save(group, hashes, success=written)
        except Exception as error:
            self._warn.warn(
                f"tier{number}-complete-save-raised",
                "tier %d: completing a write of %d blocks raised %s",
                number,
                len(hashes),
                type(error).__name__,
            )

    # ------------------------------------------------------------- reporting

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's events, then each tier's index's."""
        events = super().take_events()
        for tier in self._tiers:
            events += tier.take_events()
        return events

    def take_counters(self) -> Mapping[str, int]:
        """The pool's counts, the lookups' per tier, and each tier's index's, under `tier<N>.`."""
        counters = dict(super().take_counters())
        with self._lock:
            tier_counts, self._tier_counts = self._tier_counts, {}
        counters.update(tier_counts)
        for number, tier in enumerate(self._tiers, 1):
            for name, amount in tier.take_counters().items():
                counters[tier_prefix(number) + name] = amount
        return counters

    def reset(self) -> bool:
        """Forget the pool's and every tier's entries.

        True when none says some of its entries stayed (a tier that cannot tell counts as done).
        """
        with self._lock:
            self._found_in.clear()
        answers = [super().reset(), *(tier.reset() for tier in self._tiers)]
        return not any(answer is False for answer in answers)

    def close(self) -> None:
        """Close every tier's index, each even when one before it fails (logged)."""
        for number, tier in enumerate(self._tiers, 1):
            try:
                tier.close()
            except Exception:
                logger.exception("tier %d: closing its index failed", number)


def _by_group(
    blocks: Sequence[tuple[int, BlockHash, int]],
) -> list[tuple[int, tuple[BlockHash, ...], tuple[int, ...]]]:
    """`(group, hash, slot)` blocks as `(group, hashes, slots)`, one per group, in order."""
    by_group: dict[int, list[tuple[BlockHash, int]]] = {}
    for group, block_hash, slot in blocks:
        by_group.setdefault(group, []).append((block_hash, slot))
    return [
        (
            group,
            tuple(block_hash for block_hash, _ in entries),
            tuple(slot for _, slot in entries),
        )
        for group, entries in by_group.items()
    ]
