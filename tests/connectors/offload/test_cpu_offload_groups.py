"""The CPU-offload connector on a hybrid cache: a full-attention group and a sliding-window one.

The hybrid cache, the pair's steps and the tiny-hybrid engine checks shared
with the store connectors are ``tests.support.pairs``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

from kvwire.blocks.format import CorruptBlockError, verify_entry
from kvwire.config import EngineConfig
from kvwire.connectors.offload import CPUOffloadConnector
from kvwire.connectors.offload.metadata import OffloadMetadata
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.presets import apply_preset
from kvwire.interface.base import KVConnectorMetadata
from kvwire.interface.types import (
    BlockStored,
    Request,
    ScheduledRequest,
    SchedulerOutput,
)
from kvwire.media.cpu_pool.handler import CPUPoolTransferHandler
from tests.support.engines import (
    generate,
    renamed,
    served,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.media import name_another_block
from tests.support.pairs import (
    A_IDS,
    B_IDS,
    BLOCK,
    FULL,
    FULL_LAYERS,
    NUM_BLOCKS,
    PROMPT,
    SLIDING,
    SLIDING_LAYERS,
    HybridPair,
    assert_a_tail_shorter_than_the_window_after_a_shared_prefix_hits_warm,
    assert_block_aligned_prompts_load_as_many_tokens_with_hma_on_as_off,
    hybrid_engine_config,
    make_request,
    zero,
)


def pool_worker(connector: CPUOffloadConnector) -> CPUPoolTransferHandler:
    """A worker-role ``connector``'s CPU pool handler (built once its caches are registered)."""
    half = connector._worker
    assert half is not None, f"{connector!r} has no worker half"
    handler = half.handler
    assert isinstance(handler, CPUPoolTransferHandler), handler
    return handler


class CPUOffloadPair(HybridPair[CPUOffloadConnector]):
    """A scheduler-role and a worker-role CPU-offload connector over a hybrid cache."""

    @property
    def pool_worker(self) -> CPUPoolTransferHandler:
        return pool_worker(self.worker)

    def __init__(self, **extra: object) -> None:
        extra.setdefault("cpu_pool_bytes", "4MiB")
        super().__init__(
            CPUOffloadConnector, hybrid_engine_config("CPUOffloadConnector", dict(extra))
        )


@pytest.fixture
def hybrid() -> Iterator[type[CPUOffloadPair]]:
    pairs: list[CPUOffloadPair] = []

    class Opened(CPUOffloadPair):
        def __init__(self, **extra: object) -> None:
            super().__init__(**extra)
            pairs.append(self)

    yield Opened
    for pair in pairs:
        pair.shutdown()


def offload(pair: CPUOffloadPair, request_id: str = "a", prompt: list[int] = PROMPT) -> Request:
    request = make_request(request_id, prompt, BLOCK)
    assert pair.prefill_groups(request, A_IDS) == (0, False)
    assert pair.finish_groups(request, A_IDS) is True
    return request


@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_each_group_round_trips_bit_exact_into_other_block_ids(hybrid, async_load):
    pair = hybrid(async_load=async_load, io_threads=2)
    offload(pair)
    zero(pair, B_IDS)
    before = {name: cache.clone() for name, cache in pair.caches.items()}
    b = make_request("b", PROMPT, BLOCK)
    assert pair.prefill_groups(b, B_IDS) == (24, async_load)
    pair.step_until(lambda: not async_load or "b" in pair.finished_recving)
    assert pair.load_errors == set()
    loaded = {FULL: dict(zip(A_IDS[0][:6], B_IDS[0][:6], strict=True)), SLIDING: {12: 32, 13: 33}}
    for group, moves in loaded.items():
        for source, target in moves.items():
            for got, want in zip(
                pair.group_blocks(group, target), pair.group_blocks(group, source), strict=True
            ):
                assert torch.equal(got, want), f"group {group}: block {source} -> {target}"
    # Only group g's layers at group g's loaded ids changed.
    written = {(name, block) for name in FULL_LAYERS for block in loaded[FULL].values()}
    written |= {(name, block) for name in SLIDING_LAYERS for block in loaded[SLIDING].values()}
    for name, cache in pair.caches.items():
        for block in range(NUM_BLOCKS):
            if (name, block) not in written:
                assert torch.equal(cache[:, block], before[name][:, block]), (name, block)


@pytest.mark.parametrize(
    ("prompt", "window"), [(PROMPT, [4, 5]), (PROMPT[:24], [3, 4, 5])], ids=["25", "24-aligned"]
)
def test_the_sliding_group_stores_only_its_window_and_the_block_before_on_a_boundary(
    hybrid, prompt, window
):
    pair = hybrid()
    a = offload(pair, prompt=prompt)
    assert pair.held(FULL, a, range(6)) == [0, 1, 2, 3, 4, 5]
    # The window at the prefix's end (4-5); when the prefix ends a block, the
    # block before it too (the window a block earlier, where a prompt equal
    # to a's prefix hits, its last token recomputed).
    assert pair.held(SLIDING, a, range(6)) == window
    assert pair.stats["blocks_saved"] == 6 + len(window)
    # Confirmed per group: each group's blocks are named in an event of their own.
    stored = [event for event in pair.scheduler.take_events() if isinstance(event, BlockStored)]
    assert [(event.group, event.block_hashes) for event in stored] == [
        (0, tuple(a.block_hashes[:6])),
        (1, tuple(a.block_hashes[window[0] : 6])),
    ]


def test_the_null_block_is_never_copied(hybrid):
    pair = hybrid()
    # While a decodes, positions 0-3 of its sliding group have left the window.
    a = make_request("a", PROMPT, BLOCK)
    ids = (A_IDS[0], [0, 0, 0, 0, 12, 13, 14])
    pair.prefill_groups(a, ids)
    pair.finish_groups(a, ids)
    null_before = [cache[:, 0].clone() for cache in pair.caches.values()]
    b = make_request("b", PROMPT, BLOCK)
    assert pair.prefill_groups(b, B_IDS) == (24, False)
    assert pair.stats["blocks_saved"] == 8
    assert pair.stats["blocks_loaded"] == 8
    assert all(
        torch.equal(cache[:, 0], before)
        for cache, before in zip(pair.caches.values(), null_before, strict=True)
    )


def test_a_gap_in_the_sliding_window_moves_the_hit_back(hybrid):
    pair = hybrid()
    a = make_request("a", PROMPT, BLOCK)
    pair.admit(a, A_IDS)
    # Chunked: 2 blocks, then the rest; the sliding group saves positions 0-1,
    # then 4-5 (the window at the end, inside block 6: not the block before),
    # leaving out 2-3.
    pair.compute(a, A_IDS, 0, 8, is_new=True)
    pair.compute(a, A_IDS, 8, len(PROMPT) - 8, is_new=False)
    pair.finish_groups(a, A_IDS)
    assert pair.held(SLIDING, a, range(6)) == [0, 1, 4, 5]
    # Sharing a's first 4 blocks: the full group holds all 4, but a prefix of
    # 4 needs positions 2-3 in the sliding group; of 2, positions 0-1, held.
    d = make_request("d", PROMPT[:16] + [7] * 9, BLOCK)
    assert pair.index.count_held_prefix(FULL, d.block_hashes) == 4
    assert pair.lookup(d) == (8, False)
    # Sharing 3: positions 1-2 are needed and 2 is missing; sharing 5:
    # positions 3-4, and 3 is missing: both back to 2 blocks.
    c = make_request("c", PROMPT[:12] + [7] * 13, BLOCK)
    assert pair.lookup(c) == (8, False)
    e = make_request("e", PROMPT[:20] + [7] * 5, BLOCK)
    assert pair.lookup(e) == (8, False)
    # Sharing 6: positions 4-5 are needed, past the gap: all 6 blocks.
    f = make_request("f", [*PROMPT[:24], 7], BLOCK)
    assert pair.lookup(f) == (24, False)


def test_a_request_keeps_its_blocks_until_its_stores_in_every_group_are_confirmed(hybrid):
    pair = hybrid()
    offload(pair)
    # e shares a's first 4 blocks: the full group holds them all, the sliding
    # group lacks its window there (2-3), so e computes them and stores only
    # there: positions 2-3 (its prefix ends inside block 4: not the one before).
    e = make_request("e", PROMPT[:17], BLOCK)
    ids = ([41, 42, 43, 44, 45], [46, 47, 48, 49, 50])
    assert pair.prefill_groups(e, ids) == (0, False)
    assert pair.lookup(make_request("f", PROMPT[:17], BLOCK)) == (0, False)  # not confirmed yet
    assert pair.finish_groups(e, ids) is True
    assert pair.finished_sending == {"a", "e"}
    assert pair.stats["blocks_saved"] == 8 + 2
    assert pair.held(SLIDING, e, range(4)) == [2, 3]
    assert pair.lookup(make_request("f", PROMPT[:17], BLOCK)) == (16, False)


def test_a_request_that_stored_nothing_in_any_group_frees_its_blocks_at_once(hybrid):
    pair = hybrid()
    offload(pair)
    b = make_request("b", PROMPT, BLOCK)
    assert pair.prefill_groups(b, B_IDS) == (24, False)
    assert pair.finish_groups(b, B_IDS) is False


def test_a_mixed_up_slot_of_one_group_is_forgotten_in_that_group_only(hybrid):
    pair = hybrid()
    a = offload(pair)
    # Slots go to the full group's six blocks first, then the sliding group's two.
    name_another_block(pair.pool_worker.pool, 7)  # sliding position 5
    b = make_request("b", PROMPT, BLOCK)
    pair.prefill_groups(b, B_IDS)
    assert pair.load_errors == {33}
    assert pair.held(FULL, a, range(6)) == [0, 1, 2, 3, 4, 5]
    assert pair.held(SLIDING, a, range(6)) == [4]


def test_each_groups_entries_are_named_by_that_groups_layout(hybrid):
    pair = hybrid()
    a = offload(pair)
    pool = pair.pool_worker.pool
    # As the pool writes them: in this process's memory, no payload checksum.
    full_layout, sliding_layout = (
        attrs.evolve(layout, payload_checksum=False) for layout in pair.worker.group_layouts
    )
    assert full_layout.fingerprint != sliding_layout.fingerprint
    verify_entry(pool.entry(6), sliding_layout, a.block_hashes[4])  # sliding position 4
    with pytest.raises(CorruptBlockError, match="layout fingerprint differs"):
        verify_entry(pool.entry(6), full_layout, a.block_hashes[4])


@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_a_hybrid_engine_with_hma_on_serves_a_warm_pass_from_both_groups(async_load):
    hybrid_config = apply_preset(tiny_config(), "tiny-hybrid")
    reference = tokens(generate(hybrid_config, workload()))
    config = with_connector(
        hybrid_config, "CPUOffloadConnector", {"cpu_pool_bytes": "8MiB", "async_load": async_load}
    )
    with LLMEngine(config) as engine:
        assert engine.hma_enabled
        assert len(engine.kv_cache_config.kv_cache_groups) == 2
        cold = engine.generate(workload())
        engine.reset_prefix_cache()
        warm = engine.generate(renamed(workload(), "-warm"))
        stats = engine.connector_stats.data
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    hit_blocks = served(warm) // config.cache_config.block_size
    assert hit_blocks > 0 and stats["lookup_hit_blocks"] == hit_blocks
    # The full group loads every hit block; the sliding group only the last
    # two (its window of 8 tokens) of each request's hit, so some, not all.
    sliding_loads = stats["blocks_loaded"] - hit_blocks
    assert 0 < sliding_loads < hit_blocks


def test_a_block_aligned_prompts_warm_pass_loads_as_many_tokens_with_hma_on_as_off():
    assert_block_aligned_prompts_load_as_many_tokens_with_hma_on_as_off(
        "CPUOffloadConnector", lambda _run: {"cpu_pool_bytes": "8MiB"}, settle=False
    )


def test_a_request_with_a_tail_shorter_than_the_window_after_a_shared_prefix_hits_warm():
    assert_a_tail_shorter_than_the_window_after_a_shared_prefix_hits_warm(
        "CPUOffloadConnector", lambda _run: {"cpu_pool_bytes": "8MiB"}, settle=False
    )


# ------------------------------------------ blocks freed while a store reads them


HOLD_LIMIT_S = 60.0
"""A gate never opened lets its copies go after this, rather than hanging the test."""


def hold_copies(worker: CPUPoolTransferHandler) -> threading.Event:
    """Stores submitted from now on wait, before copying anything, until the gate opens."""
    copy = CPUPoolTransferHandler._save.__get__(worker)
    gate = threading.Event()

    def held(job: Any) -> None:
        gate.wait(HOLD_LIMIT_S)
        copy(job)

    worker._save = held  # looked up as each save is submitted
    return gate


def test_a_store_reading_a_block_given_to_another_request_is_released_and_never_published(
    hybrid,
):
    pair = hybrid()
    a = make_request("a", PROMPT, BLOCK)
    gate = hold_copies(pair.pool_worker)
    assert pair.prefill_groups(a, A_IDS) == (0, False)
    # a's stores are in flight: the full group's blocks 1-6 and the sliding
    # group's window, blocks 12-13. Next step a decodes, its window moves on
    # and frees block 12, which c gets and writes in that very step.
    c = make_request("c", [7, 8, 9], BLOCK)
    pair.admit(c, ([12], [40]))
    a_ids = (A_IDS[FULL], [0, 0, 0, 0, 0, 13, 14])
    pair.step(
        SchedulerOutput(
            scheduled=[
                ScheduledRequest("a", a_ids, len(PROMPT), 1, is_new=False),
                ScheduledRequest("c", ([12], [40]), 0, 3, is_new=True),
            ]
        )
    )
    gate.set()
    assert pair.finish_groups(a, a_ids) is True  # the full group's store still counts
    assert pair.finished_sending == {"a"}
    # Nothing of the released store is published: no hit, no event, no slot.
    assert pair.held(FULL, a, range(6)) == [0, 1, 2, 3, 4, 5]
    assert pair.held(SLIDING, a, range(6)) == []
    assert pair.stats["saves_released"] == 2
    assert pair.stats["blocks_saved"] == 6
    stored = [event for event in pair.scheduler.take_events() if isinstance(event, BlockStored)]
    assert [event.block_hashes for event in stored] == [tuple(a.block_hashes[:6])]
    assert len(pair.index._index) == 6  # the full group's six slots, the released two freed
    assert pair.lookup(make_request("f", PROMPT, BLOCK)) == (0, False)
    # The same blocks saved again, by a request whose stores end in time, hit.
    d = make_request("d", PROMPT, BLOCK)
    pair.pool_worker._save = CPUPoolTransferHandler._save.__get__(pair.pool_worker)
    d_ids = ([51, 52, 53, 54, 55, 56, 57], [58, 59, 60, 61, 62, 63, 39])
    assert pair.prefill_groups(d, d_ids) == (0, False)
    assert pair.finish_groups(d, d_ids) is True
    assert pair.held(SLIDING, d, range(6)) == [4, 5]
    assert pair.lookup(make_request("f", PROMPT, BLOCK)) == (24, False)


def test_a_hybrid_engine_whose_copies_outlive_a_step_never_saves_another_requests_bytes():
    # a's prompt ends on a block boundary, so its last step saves the
    # sliding group's window and the block before; a's next step moves its
    # window past that block and frees it, and b, admitted then, takes every
    # free block: it writes that block while a's copy of it is held. Without
    # the release, a's entry holds b's bytes under a's own header and the
    # warm pass of a, loading it, goes wrong.
    a = GenerationRequest("a", tuple((7 * i + 3) % 300 for i in range(32)), 8)
    b = GenerationRequest("b", tuple((11 * i + 5) % 300 for i in range(20)), 2)
    hybrid_config = apply_preset(tiny_config(num_gpu_blocks=28), "tiny-hybrid")

    def cold_then_warm(config: EngineConfig) -> tuple[list[RequestOutput], dict[str, Any]]:
        with LLMEngine(config) as engine:
            engine.add_request(a)
            engine.step()
            engine.add_request(b)
            engine.run_until_done()
            cold = [engine.output_of("a"), engine.output_of("b")]
            engine.reset_prefix_cache()
            warm = engine.generate(renamed([a], "-warm"))
            stats = engine.connector_stats.data if engine.connector_stats is not None else {}
        return cold + warm, stats

    reference, _ = cold_then_warm(hybrid_config)
    config = with_connector(
        hybrid_config,
        HeldCopiesCPUOffload.__name__,
        {"cpu_pool_bytes": "8MiB"},
        module_path=__name__,
    )
    outputs, stats = cold_then_warm(config)
    assert tokens(outputs) == tokens(reference)
    assert stats["saves_released"] > 0
    assert sum(output.num_preemptions for output in outputs) == 0


class HeldCopiesCPUOffload(CPUOffloadConnector):
    """CPU offload whose copies of a step start only after the next step's forward pass.

    So a block freed and given to a request in the next step is written
    before a store still meant to read it copies anything. Each step waits
    for the previous step's copies, so that the run is the same every time.
    """

    _gate: threading.Event | None = None

    def _open_gate(self) -> None:
        if self._gate is not None:
            self._gate.set()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        metadata = kv_connector_metadata
        assert isinstance(metadata, OffloadMetadata)
        super().handle_preemptions(attrs.evolve(metadata, preempted_req_ids=()))
        if metadata.preempted_req_ids:
            # Preempted requests' copies go on before the forward pass: their
            # wait would otherwise last until their deadline.
            self._open_gate()
            super().handle_preemptions(metadata)

    def wait_for_save(self) -> None:
        worker = pool_worker(self)
        self._open_gate()
        assert self._worker is not None and self._worker.transfers is not None
        assert self._worker.transfers.wait_for_saves(HOLD_LIMIT_S)
        self._gate = hold_copies(worker)
        super().wait_for_save()

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        self._open_gate()
        return super().wait_for_pending_saves(timeout_s)

    def shutdown(self) -> None:
        self._open_gate()
        super().shutdown()
