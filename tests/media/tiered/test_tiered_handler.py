"""The tiered medium's worker half: what reaches a tier comes from the pool, whole, in order.

A tier here is a handler that records what it is given, over the pool's own
memory, and whose saves wait for a gate: so a test decides when a tier's
write of a slot runs against the pool's writes of the same slot.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Set

import attrs
import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.paged_cache import group_caches
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config.extra_config import ExtraConfigKey
from kvwire.interface.counters import Counters
from kvwire.media.base import (
    JobResult,
    Medium,
    MediumContext,
    MediumIndex,
    TransferHandler,
    TransferJob,
    TransferKind,
)
from kvwire.media.tiered.handler import TieredTransferHandler
from kvwire.media.tiered.index import (
    LoadTicket,
    Place,
    SpilledBlocks,
    Spills,
    TieredLoad,
    TierSpan,
)

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
GROUP = CacheGroup(0, ("l0", "l1"), 4)
HASHES = [bytes([n]) * 32 for n in range(8)]


class RecordingTier(TransferHandler):
    """Saves copy each slot's layers into `held`, once `gate` is open; loads copy them back."""

    def __init__(self, views: Mapping[str, torch.Tensor]) -> None:
        self.views = views
        self.held: dict[bytes, list[torch.Tensor]] = {}
        self.gate = threading.Event()
        self.gate.set()
        # Loads wait for this one (bounded too).
        self.load_gate = threading.Event()
        self.load_gate.set()
        self.released: set[int] = set()
        self._jobs: dict[int, TransferJob] = {}
        self._ended: list[JobResult] = []
        self._done: dict[int, threading.Event] = {}
        self._slots: dict[int, set[int]] = {}
        self._lock = threading.Lock()

    def submit(self, job: TransferJob) -> None:
        done = self._done[job.job_id] = threading.Event()
        self._jobs[job.job_id] = job
        self._slots[job.job_id] = {slot for t in job.transfers for slot in t.block_ids}
        threading.Thread(target=self._run, args=(job, done), daemon=True).start()

    def _run(self, job: TransferJob, done: threading.Event) -> None:
        failed: list[int] = []
        for transfer in job.transfers:
            for slot, block_hash in zip(transfer.block_ids, transfer.block_hashes, strict=True):
                if job.kind is TransferKind.SAVE:
                    self.gate.wait(10)
                    if done.is_set():  # released: it commits nothing
                        return
                    self.held[block_hash] = [v[:, slot].clone() for v in self.views.values()]
                elif not self.load_gate.wait(10):
                    failed.append(slot)
                elif block_hash in self.held:
                    for view, saved in zip(self.views.values(), self.held[block_hash], strict=True):
                        view[:, slot] = saved
                else:
                    failed.append(slot)
        with self._lock:
            self._ended.append(JobResult(job.job_id, frozenset(failed)))
        done.set()

    def poll(self) -> list[JobResult]:
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        for job_id in job_ids:
            event = self._done.get(job_id)
            timeout = None if until is None else max(0.0, until - time.monotonic())
            if event is not None and not event.wait(timeout):
                return False
        return True

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        self.released |= set(block_ids)
        stopped: list[BlockTransfer] = []
        # A released save ends at once, as a store's does: it commits nothing more.
        for job_id, slots in self._slots.items():
            if slots & block_ids and not self._done[job_id].is_set():
                stopped += self._jobs[job_id].transfers
                with self._lock:
                    self._ended.append(JobResult(job_id))
                self._done[job_id].set()
        return stopped

    def close(self) -> None:
        self.gate.set()


class RecordingMedium(Medium):
    built: RecordingTier | None = None

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return ()

    def build_index(self) -> MediumIndex:
        raise NotImplementedError

    def build_handler(
        self, kv_caches: Mapping[str, torch.Tensor], counters: Counters
    ) -> TransferHandler:
        RecordingMedium.built = RecordingTier(kv_caches)
        return RecordingMedium.built


@pytest.fixture
def caches() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: torch.randn(2, 8, 4, 2, 8) for name in GROUP.layer_names}


def handler_over(
    caches: dict[str, torch.Tensor],
    *,
    write_through: bool,
    io_threads: int = 1,
    spill_buffers: int = 0,
    counters: Counters | None = None,
) -> TieredTransferHandler:
    context = MediumContext("T", {}, (GROUP,), LAYOUT)
    return TieredTransferHandler(
        layouts=(attrs.evolve(LAYOUT, payload_checksum=False),),
        caches=group_caches(caches, LAYOUT, (GROUP,)),
        num_slots=2,
        io_threads=io_threads,
        counters=counters or Counters(),
        tiers=[RecordingMedium(context)],
        groups=(GROUP,),
        write_through=write_through,
        spill_buffers=spill_buffers,
    )


def save(handler: TransferHandler, job_id: int, block: int, slot: int) -> None:
    transfer = BlockTransfer(
        request_id="r", block_ids=(block,), block_hashes=(HASHES[block],), slots=(slot,)
    )
    handler.submit(TransferJob(job_id, TransferKind.SAVE, (transfer,)))


def block_of(caches: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [cache[:, block] for cache in caches.values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@contextlib.contextmanager
def tiered(
    caches: dict[str, torch.Tensor],
    *,
    write_through: bool,
    spill_buffers: int = 0,
    counters: Counters | None = None,
) -> Iterator[tuple[TieredTransferHandler, RecordingTier]]:
    """The handler over `caches` and its one tier, block 1 saved into slot 0."""
    handler = handler_over(
        caches, write_through=write_through, spill_buffers=spill_buffers, counters=counters
    )
    tier = RecordingMedium.built
    assert tier is not None
    try:
        save(handler, 0, block=1, slot=0)
        assert handler.wait([0], time.monotonic() + 10)
        yield handler, tier
    finally:
        tier.gate.set()
        handler.close()


def spill_of(block: int, slot: int, *, for_promotion: bool = False) -> Spills:
    return Spills((SpilledBlocks(0, (HASHES[block],), (slot,), for_promotion),))


def from_tier_1(*places: Place) -> TieredLoad:
    """A load's payload: each block where `places` says; the blocks in a tier, from tier 1."""
    spans = tuple(
        TierSpan(1, position, position + 1)
        for position, place in enumerate(places)
        if place is Place.TIER
    )
    return TieredLoad(LoadTicket(0), places, spans)


def test_a_spill_reads_the_evicted_block_before_the_pool_writes_its_slot_again(caches):
    with tiered(caches, write_through=False) as (handler, tier):
        tier.gate.clear()
        handler.begin_step(spill_of(block=1, slot=0))
        save(handler, 1, block=2, slot=0)  # the slot is given to another block
        time.sleep(0.2)
        tier.gate.set()
        assert handler.wait([1], time.monotonic() + 10)
        handler.poll()
        # The tier got block 1's bytes, whole, though the pool wrote block 2 over them.
        assert same(tier.held[HASHES[1]], block_of(caches, 1))
        assert same([view[:, 0] for view in tier.views.values()], block_of(caches, 2))


def test_a_tier_write_that_holds_a_slot_too_long_is_given_up_and_the_pool_goes_on(caches):
    with tiered(caches, write_through=False) as (handler, tier):
        tier.gate.clear()  # the tier never gets to write
        handler.begin_step(spill_of(block=1, slot=0))
        save(handler, 1, block=2, slot=0)
        # Given up after TIER_WRITE_WAIT_S, well before the save's own deadline.
        assert handler.wait([1], time.monotonic() + 10)
        assert tier.released == {0}


def test_only_slots_whose_header_names_their_block_reach_a_tier(caches):
    with tiered(caches, write_through=True) as (handler, tier):
        handler.poll()  # block 1 is written through now
        # Slot 1 was never saved: its header names no block.
        handler.begin_step(spill_of(block=3, slot=1, for_promotion=True))
        deadline = time.monotonic() + 10
        while HASHES[1] not in tier.held and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert set(tier.held) == {HASHES[1]}
        assert same(tier.held[HASHES[1]], block_of(caches, 1))


def test_a_spill_for_a_promotion_is_written_at_once_the_others_with_the_step_s_saves(caches):
    with tiered(caches, write_through=False) as (handler, tier):
        save(handler, 1, block=3, slot=1)
        assert handler.wait([1], time.monotonic() + 10)
        handler.begin_step(
            Spills(
                (
                    SpilledBlocks(0, (HASHES[1],), (0,), for_promotion=False),
                    SpilledBlocks(0, (HASHES[3],), (1,), for_promotion=True),
                )
            )
        )
        # Only the promotion's slot is written before the step's loads and forward pass.
        assert [job.transfers[0].block_ids for job in tier._jobs.values()] == [(1,)]
        save(handler, 2, block=2, slot=0)  # the step's save takes slot 0: its spill goes first
        assert handler.wait([2], time.monotonic() + 10)
        assert same(tier.held[HASHES[1]], block_of(caches, 1))
        assert [job.transfers[0].block_ids for job in tier._jobs.values()] == [(1,), (0,)]


def test_a_load_into_a_slot_a_held_spill_reads_submits_that_spill_first(caches):
    with tiered(caches, write_through=False) as (handler, tier):
        handler.begin_step(spill_of(block=1, slot=0))
        assert not tier._jobs
        # Block 1 comes back from the tier into slot 0, the slot its spill reads.
        load = BlockTransfer(
            request_id="r2",
            block_ids=(5,),
            block_hashes=(HASHES[1],),
            slots=(0,),
            payload=from_tier_1(Place.TIER),
        )
        handler.submit(TransferJob(7, TransferKind.LOAD, (load,)))
        assert handler.wait([7], time.monotonic() + 10)
        (result,) = [r for r in handler.poll() if r.job_id == 7]
        assert result.failed == frozenset()
        assert same(tier.held[HASHES[1]], block_of(caches, 1))
        assert same(block_of(caches, 5), block_of(caches, 1))


def test_the_spills_held_are_written_when_the_next_step_begins(caches):
    with tiered(caches, write_through=False) as (handler, tier):
        handler.begin_step(spill_of(block=1, slot=0))
        handler.begin_step(Spills(()))
        deadline = time.monotonic() + 10
        while HASHES[1] not in tier.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert same(tier.held[HASHES[1]], block_of(caches, 1))


def test_a_load_brings_tier_blocks_through_the_pool_and_fails_missing_ones(caches):
    with tiered(caches, write_through=True) as (handler, tier):
        handler.poll()
        deadline = time.monotonic() + 10
        while HASHES[1] not in tier.held and time.monotonic() < deadline:
            time.sleep(0.01)  # the write-through lands
        load = BlockTransfer(
            request_id="r2",
            block_ids=(5, 6),
            block_hashes=(HASHES[1], HASHES[4]),
            slots=(1, 2),
            payload=from_tier_1(Place.TIER, Place.MISSING),
        )
        handler.submit(TransferJob(7, TransferKind.LOAD, (load,)))
        assert handler.wait([7], time.monotonic() + 10)
        (result,) = [r for r in handler.poll() if r.job_id == 7]
        assert result.failed == frozenset({6})
        assert same(block_of(caches, 5), block_of(caches, 1))


def test_a_load_sharing_a_block_another_load_brings_in_copies_it_once_it_arrived(caches):
    # Two copy threads: the sharing load runs while the tier's read is still held back.
    handler = handler_over(caches, write_through=False, io_threads=2)
    tier = RecordingMedium.built
    assert tier is not None
    try:
        tier.held[HASHES[1]] = block_of(caches, 1)
        tier.load_gate.clear()
        bringing = BlockTransfer(
            request_id="r1",
            block_ids=(5,),
            block_hashes=(HASHES[1],),
            slots=(1,),
            payload=from_tier_1(Place.TIER),
        )
        sharing = attrs.evolve(
            bringing, request_id="r2", block_ids=(6,), payload=from_tier_1(Place.ARRIVING)
        )
        handler.submit(TransferJob(7, TransferKind.LOAD, (bringing,)))
        handler.submit(TransferJob(8, TransferKind.LOAD, (sharing,)))
        assert not handler.wait([8], time.monotonic() + 0.3)  # waits for the read
        tier.load_gate.set()
        assert handler.wait([7, 8], time.monotonic() + 10)
        results = {r.job_id: r.failed for r in handler.poll()}
        assert results == {7: frozenset(), 8: frozenset()}
        assert same(block_of(caches, 6), block_of(caches, 1))
        assert same(block_of(caches, 5), block_of(caches, 1))
    finally:
        tier.load_gate.set()
        handler.close()


def test_a_load_sharing_a_block_whose_read_failed_fails_it_too(caches):
    handler = handler_over(caches, write_through=False, io_threads=2)
    tier = RecordingMedium.built
    assert tier is not None
    try:
        # The tier holds nothing: the read fails, and the slot names no block.
        bringing = BlockTransfer(
            request_id="r1",
            block_ids=(5,),
            block_hashes=(HASHES[1],),
            slots=(1,),
            payload=from_tier_1(Place.TIER),
        )
        sharing = attrs.evolve(
            bringing, request_id="r2", block_ids=(6,), payload=from_tier_1(Place.ARRIVING)
        )
        handler.submit(TransferJob(7, TransferKind.LOAD, (bringing, sharing)))
        assert handler.wait([7], time.monotonic() + 10)
        (result,) = handler.poll()
        assert result.failed == frozenset({5, 6})
    finally:
        handler.close()


def promote(handler: TieredTransferHandler, job_id: int, block: int, slot: int, into: int) -> None:
    """A load of `block`, found in tier 1, through pool `slot` into cache block `into`."""
    load = BlockTransfer(
        request_id=f"r{job_id}",
        block_ids=(into,),
        block_hashes=(HASHES[block],),
        slots=(slot,),
        payload=from_tier_1(Place.TIER),
    )
    handler.submit(TransferJob(job_id, TransferKind.LOAD, (load,)))


def written_slots(tier: RecordingTier) -> list[tuple[int, ...]]:
    return [
        job.transfers[0].block_ids for job in tier._jobs.values() if job.kind is TransferKind.SAVE
    ]


def test_a_promotion_s_slot_is_spilled_from_a_buffer_and_the_promotion_does_not_wait(caches):
    with tiered(caches, write_through=False, spill_buffers=1) as (handler, tier):
        tier.held[HASHES[3]] = block_of(caches, 3)
        tier.gate.clear()  # the tier's writes wait
        handler.begin_step(spill_of(block=1, slot=0, for_promotion=True))
        promote(handler, 7, block=3, slot=0, into=5)
        # The load ends while the spill's write still waits: it wrote slot 0 without
        # giving that write up, which reads block 1 from the buffer (slot 2).
        assert handler.wait([7], time.monotonic() + 10)
        (result,) = [r for r in handler.poll() if r.job_id == 7]
        assert result.failed == frozenset()
        assert same(block_of(caches, 5), block_of(caches, 3))
        assert written_slots(tier) == [(2,)]
        tier.gate.set()
        deadline = time.monotonic() + 10
        while HASHES[1] not in tier.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert same(tier.held[HASHES[1]], block_of(caches, 1))
        assert tier.released == set()


def test_a_slot_found_no_free_buffer_is_spilled_from_itself_and_a_buffer_is_reused(caches):
    counters = Counters()
    with tiered(caches, write_through=False, spill_buffers=1, counters=counters) as (
        handler,
        tier,
    ):
        save(handler, 1, block=2, slot=1)
        assert handler.wait([1], time.monotonic() + 10)
        tier.gate.clear()
        handler.begin_step(
            Spills((SpilledBlocks(0, (HASHES[1], HASHES[2]), (0, 1), for_promotion=True),))
        )
        # One buffer: block 1 through it, block 2 from its own slot.
        assert written_slots(tier) == [(2,), (1,)]
        assert counters.take()["spills_without_buffer"] == 1
        tier.gate.set()
        deadline = time.monotonic() + 10
        while len(tier.held) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert same(tier.held[HASHES[1]], block_of(caches, 1))
        assert same(tier.held[HASHES[2]], block_of(caches, 2))
        # The buffer's write ended (a poll tells): the next promotion's spill takes it again.
        while any(not done.is_set() for done in tier._done.values()):
            time.sleep(0.01)
        handler.poll()
        handler.begin_step(spill_of(block=2, slot=1, for_promotion=True))
        assert written_slots(tier)[-1] == (2,)


def test_a_promotion_that_waits_for_its_slots_spill_counts_the_wait(caches):
    counters = Counters()
    with tiered(caches, write_through=False, counters=counters) as (handler, tier):
        tier.held[HASHES[3]] = block_of(caches, 3)
        counters.take()
        tier.gate.clear()  # the spill's write waits
        handler.begin_step(spill_of(block=1, slot=0, for_promotion=True))  # no buffer
        promote(handler, 7, block=3, slot=0, into=5)
        time.sleep(0.2)
        assert not handler.wait([7], time.monotonic())  # reading into slot 0 must wait
        tier.gate.set()
        assert handler.wait([7], time.monotonic() + 10)
        handler.poll()
        assert same(block_of(caches, 5), block_of(caches, 3))
        taken = counters.take()
        # The load waited out the write (at least the 0.2 s above), within its promotion.
        assert taken["promotion_wait_seconds"] >= 0.2
        assert taken["promotion_seconds"] >= taken["promotion_wait_seconds"]
        assert taken["spills_without_buffer"] == 1


def test_spill_buffers_are_a_number_of_entries(caches):
    with pytest.raises(ValueError, match="spill_buffers is a number of entries, >= 0; got -1"):
        handler_over(caches, write_through=False, spill_buffers=-1)


def direct_handler(
    caches: dict[str, torch.Tensor], *, pool_timeout_s: float, direct_timeout_s: float
) -> tuple[TieredTransferHandler, RecordingTier, Counters]:
    """A handler whose tier's blocks are read straight into `caches`; that tier's reads."""
    counters = Counters()
    options = {"transfer_timeout_s": direct_timeout_s}
    handler = TieredTransferHandler(
        layouts=(attrs.evolve(LAYOUT, payload_checksum=False),),
        caches=group_caches(caches, LAYOUT, (GROUP,)),
        num_slots=2,
        io_threads=1,
        counters=counters,
        transfer_timeout_s=pool_timeout_s,
        tiers=[RecordingMedium(MediumContext("T", {}, (GROUP,), LAYOUT))],
        groups=(GROUP,),
        write_through=False,
        direct=([RecordingMedium(MediumContext("T", options, (GROUP,), LAYOUT))], caches),
    )
    direct = RecordingMedium.built  # the last built: over the engine's cache
    assert direct is not None
    return handler, direct, counters


def read_direct(handler: TieredTransferHandler, job_id: int, *places: Place) -> None:
    """A load into cache blocks 5, 6, ...: block 1 from pool slot 0, or blocks 3, 4, ... direct."""
    direct = iter(HASHES[3:])
    hashes = [HASHES[1] if place is Place.POOL else next(direct) for place in places]
    spans = tuple(
        TierSpan(1, position, position + 1, direct=True)
        for position, place in enumerate(places)
        if place is Place.DIRECT
    )
    load = BlockTransfer(
        request_id=f"r{job_id}",
        block_ids=tuple(range(5, 5 + len(places))),
        block_hashes=tuple(hashes),
        slots=tuple(0 if place is Place.POOL else 3 for place in places),
        payload=TieredLoad(LoadTicket(0), places, spans),
    )
    handler.submit(TransferJob(job_id, TransferKind.LOAD, (load,)))


def test_a_direct_span_is_read_into_the_cache_by_the_tier_never_through_the_pool(caches):
    handler, direct, counters = direct_handler(caches, pool_timeout_s=10, direct_timeout_s=5)
    try:
        save(handler, 0, block=1, slot=0)
        assert handler.wait([0], time.monotonic() + 10)
        direct.held[HASHES[3]] = [block.clone() for block in block_of(caches, 3)]
        read_direct(handler, 7, Place.POOL, Place.DIRECT, Place.DIRECT)  # HASHES[4]: nowhere
        assert handler.wait([7], time.monotonic() + 10)
        (result,) = [r for r in handler.poll() if r.job_id == 7]
        assert result.failed == frozenset({7})
        assert same(block_of(caches, 5), block_of(caches, 1))
        assert same(block_of(caches, 6), block_of(caches, 3))
        # The tier read into cache blocks; nothing was read into a pool slot.
        reads = [job.transfers[0].block_ids for job in direct._jobs.values()]
        assert reads == [(6,), (7,)]
        assert "direct_reads_too_late" not in counters.take()
    finally:
        handler.close()


def test_a_direct_read_that_could_outlive_its_load_is_never_started(caches):
    # The tier's deadline is as long as the pool's: its read could still write the
    # cache after the load gave up on its blocks, so the block fails unread.
    handler, direct, counters = direct_handler(caches, pool_timeout_s=10, direct_timeout_s=10)
    try:
        direct.held[HASHES[3]] = [block.clone() for block in block_of(caches, 3)]
        before = [block.clone() for block in block_of(caches, 5)]
        read_direct(handler, 7, Place.DIRECT)
        assert handler.wait([7], time.monotonic() + 10)
        (result,) = [r for r in handler.poll() if r.job_id == 7]
        assert result.failed == frozenset({5})
        assert direct._jobs == {}
        assert same(block_of(caches, 5), before)
        assert counters.take()["direct_reads_too_late"] == 1
    finally:
        handler.close()


def around(handler: TieredTransferHandler, job_id: int, *pool_slots: int) -> None:
    """A save of cache blocks 3, 4, ...: into `pool_slots`, then the rest around the pool."""
    count = len(pool_slots) + 2
    around_slot = 2  # the handler's two slots, no spill buffer: the slot past them
    transfer = BlockTransfer(
        request_id=f"r{job_id}",
        block_ids=tuple(range(3, 3 + count)),
        block_hashes=tuple(HASHES[3 : 3 + count]),
        slots=(*pool_slots, around_slot, around_slot),
    )
    handler.submit(TransferJob(job_id, TransferKind.SAVE, (transfer,)))


def test_a_save_s_blocks_around_the_pool_go_to_the_tier_from_the_cache_and_end_its_job(caches):
    handler, direct, _ = direct_handler(caches, pool_timeout_s=10, direct_timeout_s=5)
    try:
        direct.gate.clear()  # the tier's writes wait
        around(handler, 7, 0)
        # The pool's part ended; the job waits for the writes around the pool.
        assert not handler.wait([7], time.monotonic() + 0.3)
        assert [r.job_id for r in handler.poll()] == []
        direct.gate.set()
        assert handler.wait([7], time.monotonic() + 10)
        assert [r.job_id for r in handler.poll()] == [7]
        # Blocks 4 and 5 from the cache, block 3 into pool slot 0 only.
        assert sorted(direct.held) == [HASHES[4], HASHES[5]]
        assert same(direct.held[HASHES[4]], block_of(caches, 4))
        assert handler.take_counters()["tier1.written_around_blocks"] == 2
        load = BlockTransfer(
            request_id="r8",
            block_ids=(6,),
            block_hashes=(HASHES[3],),
            slots=(0,),
            payload=TieredLoad(LoadTicket(0), (Place.POOL,), ()),
        )
        handler.submit(TransferJob(8, TransferKind.LOAD, (load,)))
        assert handler.wait([8], time.monotonic() + 10)
        assert same(block_of(caches, 6), block_of(caches, 3))
    finally:
        direct.gate.set()
        handler.close()


def test_a_save_wholly_around_the_pool_ends_once_its_writes_did(caches):
    handler, direct, _ = direct_handler(caches, pool_timeout_s=10, direct_timeout_s=5)
    try:
        around(handler, 7)
        assert handler.wait([7], time.monotonic() + 10)
        assert [r.job_id for r in handler.poll()] == [7]
        assert sorted(direct.held) == [HASHES[3], HASHES[4]]
    finally:
        handler.close()


def test_a_release_stops_the_writes_around_the_pool_reading_blocks_about_to_be_written(caches):
    handler, direct, _ = direct_handler(caches, pool_timeout_s=10, direct_timeout_s=5)
    try:
        direct.gate.clear()
        around(handler, 7)
        stopped = handler.release_saves_reading((), frozenset({4}))
        # Reported once, with its request and hashes: the scheduler never publishes them.
        assert [(t.request_id, t.block_hashes) for t in stopped] == [("r7", (HASHES[3], HASHES[4]))]
        assert handler.wait([7], time.monotonic() + 10)
        assert [r.job_id for r in handler.poll()] == [7]
        direct.gate.set()
        time.sleep(0.1)
        assert direct.held == {}  # a released write commits nothing
    finally:
        direct.gate.set()
        handler.close()
