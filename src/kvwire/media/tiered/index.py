"""The tiered medium's scheduler half: the pool's index, the tiers' indexes, where each load reads.

`TieredIndex` is a CPU pool's index (`CPUPoolIndex`) and each secondary
tier's own index, each used through its public calls. A lookup counts the
blocks the pool holds, then asks each tier in turn for the blocks after
them; a block the pool holds ready after those counts too, and the tiers
are asked again for the blocks after it. It remembers which tier held each
block (by group and hash, for a bounded number of blocks: requests that
share a prefix share these records, whatever order their lookups and loads
come in). When the load is prepared,
each block is taken where it is now (`Place`): the pool's ready blocks are
pinned as a CPU pool load pins them, before any block is brought in (whose
slot may come from evicting a block); a block another load is bringing in is
shared with it (`CPUPoolIndex.join_promotion`: a lookup made before that
load was prepared counted it, as `async_lookup` does); a block found in a
tier gets a pool slot, pinned and not ready (`CPUPoolIndex.start_promotion`):
the worker reads it from its tier into that slot, then copies the slots
into the cache. An index that does not promote (`promotes=False`) gives a
block found in a tier no slot (`Place.DIRECT`): the worker reads it from
its tier straight into the cache, and the pool never holds it. A block that
left the pool between the lookup and the load, or found no free slot to be
brought into, is `Place.MISSING`: a load error,
which the engine computes again (counted in `load_blocks_missing`). A lookup
counts no more blocks from the tiers than the pool has slots to bring them
into (when it promotes), so that this stays rare.

The load's payload (`TieredLoad`) tells the worker half where each block is,
and which spans of blocks each tier reads (with that tier's own payload);
its `ticket` names the load when `complete_load` hands it back.

Which blocks reach the secondary tiers: with `write_through`, every block
whose pool save is made (the worker writes it once the pool's save job
ended); with `spill`, each ready block the pool evicts while no tier holds
it yet (`take_step_payload` gives them as `Spills`, which the worker writes
from their slots before those slots are written again). With
`write_around`, a block of a save that the pool does not take (its
admission refused it, or every slot was pinned) and neither holds nor is
writing around already gets the slot past the pool's memory: the worker
writes it to the tiers straight from the cache, as a tier alone would
(`complete_save` tells these blocks from the pool's by that record). Every tier is found
by key (`Medium.found_by_key`): its worker half writes it on its own, and its
index places nothing.

Lookups may run on a lookup thread (`concurrent_lookups`): the pool's
count only reads its slot table (a stale answer is caught when the load is
prepared) and, for a policy that takes the hint, notes where the prompt
ends under a lock of its own, and a tier whose own index does not allow it is left out of a
lookup made off the scheduler's thread.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import attrs

from kvwire.blocks.transfers import TransferPayload
from kvwire.common.redaction import SHOWN_LENGTH, redact_text, shown
from kvwire.interface.types import BlockHash, KVCacheEvent
from kvwire.media.admission import SaveAdmission
from kvwire.media.base import LoadSpec, MediumIndex
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.eviction import EvictionPolicy
from kvwire.media.rate_limited import RateLimitedWarning

__all__ = [
    "LoadTicket",
    "Place",
    "SpilledBlocks",
    "Spills",
    "TierSpan",
    "TieredIndex",
    "TieredLoad",
    "tier_prefix",
]

logger = logging.getLogger(__name__)

# Blocks whose tier a lookup found, kept for their loads: far more than one step admits.
_MAX_FOUND_BLOCKS = 65536
# The lookup-delay buckets reported per tier, in seconds, with their counter names.
_DELAY_BUCKETS = ((0.001, "lookups_le_1ms"), (0.01, "lookups_le_10ms"), (0.1, "lookups_le_100ms"))


def tier_prefix(number: int) -> str:
    """The prefix of secondary tier `number`'s counters (`tier1.`)."""
    return f"tier{number}."


class Place(enum.Enum):
    """Where a block to load is when its load is prepared."""

    POOL = enum.auto()
    """Ready in the pool: copied from its slot."""
    ARRIVING = enum.auto()
    """Being brought into its slot by another load: copied once that read ended."""
    TIER = enum.auto()
    """In a secondary tier: read into its slot by this load (see `TierSpan`), then copied."""
    DIRECT = enum.auto()
    """In a secondary tier: read by this load straight into the cache (see `TierSpan`)."""
    MISSING = enum.auto()
    """Nowhere a load can read it from any more: the worker fails it, reading nothing."""


@attrs.frozen
class LoadTicket:
    """Names one prepared load, from `prepare_load` to its `complete_load`."""

    serial: int


@attrs.frozen
class TierSpan:
    """Blocks `start:stop` of a load, read from secondary tier `tier` into their pool slots.

    `direct`: read into the load's cache blocks instead (`Place.DIRECT`).
    """

    tier: int
    start: int
    stop: int
    payload: TransferPayload | None = None
    """The tier's own payload for these blocks (its index's `LoadSpec.payload`)."""
    direct: bool = False

    def part(self, start: int, stop: int) -> TierSpan | None:
        """This span's blocks within the load's blocks `start:stop`, counted from `start`."""
        first, last = max(self.start, start), min(self.stop, stop)
        if first >= last:
            return None
        payload = self.payload
        if payload is not None:
            payload = payload.part(first - self.start, last - self.start)
        return TierSpan(self.tier, first - start, last - start, payload, self.direct)


@attrs.frozen
class TieredLoad(TransferPayload):
    """A load's payload: where each block is (`places`), and what each tier reads (`spans`)."""

    ticket: LoadTicket
    places: tuple[Place, ...]
    spans: tuple[TierSpan, ...] = ()

    def part(self, start: int, stop: int) -> TieredLoad:
        spans = (span.part(start, stop) for span in self.spans)
        return TieredLoad(
            self.ticket,
            self.places[start:stop],
            tuple(span for span in spans if span is not None),
        )


@attrs.frozen
class SpilledBlocks:
    """Blocks of one KV cache group to write to the tiers, from their pool slots.

    `for_promotion`: evicted to give this step's promotions their slots, which
    the step's loads write as soon as these writes have read them.
    """

    group: int
    block_hashes: tuple[BlockHash, ...]
    slots: tuple[int, ...]
    for_promotion: bool = False


@attrs.frozen
class Spills(TransferPayload):
    """A step's payload: the blocks the pool evicted that no tier holds yet.

    The worker writes each from its slot before anything writes that slot
    again, one tier job per record, in order. The blocks evicted to give this
    step's promotions their slots come first, each group's in a record of its
    own (`for_promotion`), written before the step's loads: a promotion waits
    for the writes of its own slots only, which the tiers start first. Then
    one record per group of the others (slots the step's saves take), which
    the worker writes when it submits those saves, after the forward pass.
    """

    groups: tuple[SpilledBlocks, ...]


@attrs.define
class _Plan:
    """A load being prepared: each block's slot, tier (0: the pool; None: missing) and place,
    and the spans the tiers read."""

    slots: list[int] = attrs.field(factory=list)
    tiers: list[int | None] = attrs.field(factory=list)
    places: list[Place] = attrs.field(factory=list)
    spans: list[TierSpan] = attrs.field(factory=list)


class TieredIndex(MediumIndex):
    """A CPU pool's index with secondary tiers' indexes behind it (see the module).

    The pool is a `CPUPoolIndex` over `num_slots` slots shared by
    `num_groups` KV cache groups, named `medium` in the KV cache events,
    evicting as `policy` says and saving what `admission` admits; `tiers`
    are the secondary tiers' indexes, first looked up first, each found by
    key. `write_through`: every block whose pool save is made is written to
    the tiers (else only those the pool evicts that no tier holds).
    `spill_buffers`: the entries of the pool's memory after its slots, which
    the worker spills through; a missing block's slot is past them too, so
    that no entry of the memory stands for it. `promotes`: whether a block
    found in a tier is brought into the pool (else read straight into the
    cache, `Place.DIRECT`). `write_around`: a block the pool does not take
    is written to the tiers from the cache (see the module).
    """

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
        spill_buffers: int = 0,
        promotes: bool = True,
        write_around: bool = False,
    ) -> None:
        if not tiers:
            raise ValueError("TieredIndex: expected at least one secondary tier's index")
        self.pool = CPUPoolIndex(
            num_slots,
            num_groups,
            medium,
            policy=policy,
            admission=admission,
            on_evict=self._evicted,
        )
        """The primary tier's index."""
        # The slot of a block no tier can give: one past every entry of the pool's memory.
        self._missing_slot = num_slots + spill_buffers
        self._tiers = tuple(tiers)
        self._write_through = write_through
        self._promotes = promotes
        self._write_around = write_around
        # Blocks being written around the pool, by (group, hash): one save writes each.
        self._around: set[tuple[int, BlockHash]] = set()
        self._scheduler_thread = threading.get_ident()
        self._warn = RateLimitedWarning(logger)
        self._tickets = itertools.count()
        # Written by lookup threads too: every change of these under the lock.
        self._lock = threading.Lock()
        # Which tier a lookup found each block in, by (group, hash); oldest dropped first.
        self._found_in: dict[tuple[int, BlockHash], int] = {}
        # Blocks being brought in, by (group, hash): the tier each comes from.
        self._arriving_from: dict[tuple[int, BlockHash], int] = {}
        self._counts: dict[str, int] = {}
        # Prepared loads not completed yet, by ticket: each block's tier (0: the pool;
        # None: missing).
        self._loads: dict[LoadTicket, tuple[int | None, ...]] = {}
        # Blocks to spill (group, hash, slot): those evicted for a promotion, and the others.
        self._promotion_spills: list[tuple[int, BlockHash, int]] = []
        self._spills: list[tuple[int, BlockHash, int]] = []
        self._promoting = False

    def _evicted(self, group: int, block_hash: BlockHash, slot: int, clean: bool) -> None:
        """The pool's `on_evict`: with `spill`, a ready block no tier holds is written to them."""
        if not clean and not self._write_through:
            spills = self._promotion_spills if self._promoting else self._spills
            spills.append((group, block_hash, slot))

    # --------------------------------------------------------------- lookups

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """The pool's ready prefix, extended by the tiers and the pool's ready blocks after it.

        After the pool's prefix, each run of blocks the pool lacks is looked up
        in each secondary tier in turn (the blocks after the ones the tier
        before it holds); a block the pool holds ready in the middle of the
        prompt is counted as the pool's, and the lookup goes on after it. The
        prefix ends at a block no tier holds, or one the pool holds but cannot
        give yet (still being saved, or brought in by another load: it can take
        no slot to be brought in either).
        """
        pool = self.pool
        held = pool.count_held_prefix(group, block_hashes)
        # Blocks from the tiers each need a slot the load can take, and a ready block
        # this load pins is one slot fewer to evict: no more than are neither busy
        # nor this load's own (a block promised and then given no slot would be a
        # load error, which costs vLLM a rescheduled request).
        budget = max(0, pool.num_slots - pool.busy_slots - held)
        if not self._promotes:
            budget = len(block_hashes)  # blocks read straight into the cache take no slot
        on_scheduler_thread = threading.get_ident() == self._scheduler_thread
        while budget and held < len(block_hashes):
            end = min(len(block_hashes), held + budget)
            lacking_end = next(
                (i for i in range(held, end) if pool.holds(group, block_hashes[i])), end
            )
            if lacking_end > held:
                found = self._count_in_tiers(
                    group, block_hashes, held, lacking_end, on_scheduler_thread
                )
                held += found
                budget -= found
                if held < lacking_end:
                    break  # a block no tier holds
            if held == end or not pool.ready(group, block_hashes[held]):
                break
            held += 1
            budget -= 1
        return held

    def _count_in_tiers(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        start: int,
        stop: int,
        on_scheduler_thread: bool,
    ) -> int:
        """How many of `block_hashes[start:stop]`, from the first, the tiers hold in turn."""
        held = start
        for number, tier in enumerate(self._tiers, 1):
            if held >= stop:
                break
            if not (on_scheduler_thread or tier.concurrent_lookups):
                continue
            found = self._count_in_tier(number, tier, group, block_hashes[held:stop])
            if found:
                self._record_found(number, group, block_hashes[held : held + found])
                held += found
        return held - start

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
        self._count_many(counts)
        return found

    # ----------------------------------------------------------------- loads

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> LoadSpec:
        """Take each block where it is now (see the module); every block's slot, and the payload.

        A missing block gets a slot past the pool's memory, which the worker never reads.
        """
        if not block_hashes:
            return LoadSpec()
        with self._lock:
            found = [self._found_in.get((group, block_hash)) for block_hash in block_hashes]
        where = [self._where(group, h, tier) for h, tier in zip(block_hashes, found, strict=True)]
        spans = list(_runs(where))
        # The pool's ready blocks are pinned first: a promotion's evictions cannot take them.
        pinned = {
            start: self.pool.prepare_load(group, block_hashes[start:end]).slots
            for start, end in spans
            if where[start][0] is Place.POOL
        }
        plan = _Plan()
        for position, end in spans:
            span = block_hashes[position:end]
            place, number = where[position]
            if place is Place.POOL:
                plan.slots += pinned[position]
                plan.tiers += [0] * len(span)
                plan.places += [Place.POOL] * len(span)
            elif place is Place.ARRIVING:
                shared = self.pool.join_promotion(group, span)
                for slot in shared:
                    if slot is None:
                        self._missing(plan)
                    else:
                        plan.slots.append(slot)
                        plan.tiers.append(number)
                        plan.places.append(Place.ARRIVING)
            elif place is Place.TIER and self._promotes:
                self._bring_in(number, group, span, plan)
            elif place is Place.TIER:
                self._read_direct(number, group, span, plan)
            else:
                for _ in span:
                    self._missing(plan)
        ticket = LoadTicket(next(self._tickets))
        self._loads[ticket] = tuple(plan.tiers)
        payload = TieredLoad(ticket, tuple(plan.places), tuple(plan.spans))
        return LoadSpec(slots=tuple(plan.slots), payload=payload)

    def _where(self, group: int, block_hash: BlockHash, found_in: int | None) -> tuple[Place, int]:
        """Where a block to load is now, and the tier it comes from (0: the pool or none)."""
        pool = self.pool
        if pool.ready(group, block_hash):
            return Place.POOL, 0
        arriving_from = self._arriving_from.get((group, block_hash))
        if arriving_from is not None and pool.arriving(group, block_hash):
            return Place.ARRIVING, arriving_from
        if found_in is not None and not pool.holds(group, block_hash):
            return Place.TIER, found_in
        # Left the pool since the lookup, or still being saved: nowhere to read it from.
        return Place.MISSING, 0

    def _bring_in(self, number: int, group: int, span: Sequence[BlockHash], plan: _Plan) -> None:
        """Slots for `span`, found in tier `number`; a block with none is missing.

        Each run of blocks given a slot is one `TierSpan`, with its part of the tier's payload.
        """
        # Its evictions' spills are written first: this load waits for them (see Spills).
        self._promoting = True
        try:
            taken = self.pool.start_promotion(group, span)
        finally:
            self._promoting = False
        spec = self._prepare_tier_load(number, group, span)
        if spec is None:
            self.pool.finish_promotion(
                group, [h for h, slot in zip(span, taken, strict=True) if slot is not None], span
            )
            taken = [None] * len(span)
        first = len(plan.places)
        run_start: int | None = None
        for offset, (block_hash, slot) in enumerate(zip(span, taken, strict=True)):
            if slot is None:
                self._missing(plan)
            else:
                self._arriving_from[(group, block_hash)] = number
                plan.slots.append(slot)
                plan.tiers.append(number)
                plan.places.append(Place.TIER)
            if slot is not None and run_start is None:
                run_start = offset
            if run_start is not None and (slot is None or offset == len(span) - 1):
                run_stop = offset if slot is None else offset + 1
                payload = None if spec is None else spec.payload
                if payload is not None and (run_start, run_stop) != (0, len(span)):
                    payload = payload.part(run_start, run_stop)
                plan.spans.append(TierSpan(number, first + run_start, first + run_stop, payload))
                run_start = None

    def _read_direct(self, number: int, group: int, span: Sequence[BlockHash], plan: _Plan) -> None:
        """`span`, found in tier `number`, read straight into the cache: one direct `TierSpan`.

        Its blocks take no pool slot; each gets the missing block's, never read.
        """
        spec = self._prepare_tier_load(number, group, span)
        if spec is None:
            for _ in span:
                self._missing(plan)
            return
        first = len(plan.places)
        plan.slots += [self._missing_slot] * len(span)
        plan.tiers += [None] * len(span)
        plan.places += [Place.DIRECT] * len(span)
        plan.spans.append(TierSpan(number, first, first + len(span), spec.payload, direct=True))
        self._count_many({tier_prefix(number) + "direct_blocks": len(span)})

    def _missing(self, plan: _Plan) -> None:
        """A block of the load no tier can give: a slot past the pool's memory, never read."""
        plan.slots.append(self._missing_slot)
        plan.tiers.append(None)
        plan.places.append(Place.MISSING)
        self._count_many({"load_blocks_missing": 1})

    def _prepare_tier_load(
        self, number: int, group: int, span: Sequence[BlockHash]
    ) -> LoadSpec | None:
        """Tier `number`'s load of `span` prepared; None when it cannot load them."""
        tier = self._tiers[number - 1]
        try:
            spec = tier.prepare_load(group, span)
            if not spec.slots:
                return spec
            tier.complete_load(group, span, (), payload=spec.payload)
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
            "tier's load cannot use: it must find its blocks by key or by its payload; "
            "%d blocks computed again",
            number,
            len(span),
        )
        return None

    def complete_load(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        corrupt: Sequence[BlockHash],
        payload: TransferPayload | None = None,
    ) -> None:
        """Unpin the pool's blocks; the blocks brought in become hits, unless they failed."""
        if not isinstance(payload, TieredLoad):
            return  # no blocks: nothing was prepared
        tiers = self._loads.pop(payload.ticket, None)
        if tiers is None:
            return
        in_pool = [h for h, tier in zip(block_hashes, tiers, strict=True) if tier == 0]
        bad = set(corrupt)
        self.pool.complete_load(group, in_pool, [h for h in in_pool if h in bad])
        for number, tier in enumerate(self._tiers, 1):
            positions = [i for i, where in enumerate(tiers) if where == number]
            arriving = [block_hashes[i] for i in positions]
            if arriving:
                bad_arriving = [h for h in arriving if h in bad]
                ready = self.pool.finish_promotion(group, arriving, bad_arriving)
                if ready:
                    self._count_many({tier_prefix(number) + "promoted_blocks": len(ready)})
            for block_hash in arriving:
                if not self.pool.arriving(group, block_hash):
                    self._arriving_from.pop((group, block_hash), None)
            # Only the blocks this load read from the tier (brought in or read
            # straight into the cache; not those it shared); the tier's handler
            # judged its own entries as it read them.
            for span in payload.spans:
                if span.tier == number:
                    brought = block_hashes[span.start : span.stop]
                    tier.complete_load(group, brought, (), payload=span.payload)
        self.pool.record_evictions()

    # ----------------------------------------------------------------- saves

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        """The pool's places; with `write_around`, the slot past its memory for the blocks it
        does not take, which the worker writes to the tiers from the cache."""
        if not self._write_around:
            return self.pool.prepare_save(group, block_hashes)
        # A block already being written around is offered to neither: each hash's
        # complete_save is then the pool's or the tiers', never both.
        offered = [h for h in block_hashes if (group, h) not in self._around]
        placed = dict(self.pool.prepare_save(group, offered))
        answer: list[tuple[BlockHash, int | None]] = []
        for block_hash in offered:
            slot = placed.get(block_hash)
            if slot is None and not self.pool.holds(group, block_hash):
                self._around.add((group, block_hash))
                slot = self._missing_slot
            if slot is not None:
                answer.append((block_hash, slot))
        return answer

    def complete_save(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        """As the pool's; with `write_through`, the tiers hold the blocks too.

        The worker wrote them to the tiers once the pool's save job ended.
        Blocks written around the pool are the tiers' alone: only forgotten here.
        """
        if self._around:
            around = self._around
            in_pool = [h for h in block_hashes if (group, h) not in around]
            around.difference_update((group, h) for h in block_hashes)
            block_hashes = in_pool
        self.pool.complete_save(group, block_hashes, success=success)
        if success and self._write_through:
            self.pool.mark_clean(group, block_hashes)

    def take_step_payload(self) -> Spills | None:
        """The blocks evicted that no tier holds, since the last call (`Spills`); None for none.

        Those evicted for promotions first, in records of their own.
        """
        if not (self._promotion_spills or self._spills):
            return None
        records = (
            *_by_group(self._promotion_spills, for_promotion=True),
            *_by_group(self._spills, for_promotion=False),
        )
        self._promotion_spills, self._spills = [], []
        return Spills(records)

    # ------------------------------------------------------------- reporting

    def _count_many(self, counts: Mapping[str, int]) -> None:
        with self._lock:
            for name, amount in counts.items():
                self._counts[name] = self._counts.get(name, 0) + amount

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's events, then each tier's index's."""
        events = self.pool.take_events()
        for tier in self._tiers:
            events += tier.take_events()
        return events

    def take_counters(self) -> Mapping[str, int]:
        """The pool's counts, the lookups' per tier, and each tier's index's, under `tier<N>.`."""
        counters = dict(self.pool.take_counters())
        with self._lock:
            counts, self._counts = self._counts, {}
        counters.update(counts)
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
        answers = [self.pool.reset(), *(tier.reset() for tier in self._tiers)]
        return not any(answer is False for answer in answers)

    def close(self) -> None:
        """Close every tier's index, each even when one before it fails (logged)."""
        for number, tier in enumerate(self._tiers, 1):
            try:
                tier.close()
            except Exception:
                logger.exception("tier %d: closing its index failed", number)


def _by_group(
    spills: Sequence[tuple[int, BlockHash, int]], *, for_promotion: bool
) -> list[SpilledBlocks]:
    """One record per group of these spills (group, hash, slot), in the order given."""
    by_group: dict[int, list[tuple[BlockHash, int]]] = {}
    for group, block_hash, slot in spills:
        by_group.setdefault(group, []).append((block_hash, slot))
    return [
        SpilledBlocks(
            group,
            tuple(block_hash for block_hash, _ in blocks),
            tuple(slot for _, slot in blocks),
            for_promotion,
        )
        for group, blocks in by_group.items()
    ]


def _runs(values: Sequence[object]) -> Iterator[tuple[int, int]]:
    """The runs of equal neighbours in `values`, each as its (start, stop) positions."""
    start = 0
    for position in range(1, len(values) + 1):
        if position == len(values) or values[position] != values[start]:
            yield start, position
            start = position
