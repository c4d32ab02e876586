"""Saves read the cache blocks in place: the blocks must not change until they are written.

Shared storage saves in the background, straight from the KV cache. The
engine must not reuse a block while a save reads it: a finished request keeps
its blocks until its saves end (``request_finished`` returns True, then
``finished_sending``), and a preempted request's saves end before the next
forward pass (``handle_preemptions``). Here every write is held until the
next step's forward pass has run (or until the engine waits for saves before
it), then checks that the bytes it was given did not change meanwhile.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Generator, Iterable, Mapping, Sequence, Set
from typing import Any

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.memory import BlockMemory
from kvwire.blocks.transfers import BlockTransfer
from kvwire.connectors.offload import SharedStorageConnector
from kvwire.connectors.offload.metadata import OffloadMetadata
from kvwire.engine.engine import LLMEngine
from kvwire.engine.presets import apply_preset
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockStored, KVCacheBlocks, SchedulerOutput
from kvwire.media.base import MediumContext
from kvwire.media.store._handler import StoreTransferHandler
from kvwire.media.store.base import BlockStore, CacheWrites
from kvwire.media.store.directory import DirectoryMedium
from kvwire.media.store.directory.block_store import DirectoryBlockStore
from tests.support.engines import generate as generate_without
from tests.support.engines import (
    renamed,
    tiny_config,
    tokens,
    with_connector,
    workload,
)
from tests.support.media import DrivenHandler
from tests.support.pairs import PairFactory, make_request
from tests.support.stores import HASHES, layout_caches
from tests.support.waits import wait_until

BLOCK = 4
PROMPT = list(range(100, 117))
PRODUCER_BLOCKS = [3, 7, 1, 9, 12]
# How long a held write waits at most (a bound, never reached when the rules hold).
HOLD_LIMIT_S = 30.0
LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")

CHANGED_UNDER_SAVE: list[str] = []
"""Keys committed although their cache bytes changed while their save held them."""


class _Progress:
    """What held writes wait for: the next forward pass, or the engine waiting for them."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.steps = 0
        # Waits of the engine for saves under way: held writes go on meanwhile
        # (the saves waited for may be queued behind them).
        self.waits = 0
        self.draining = False


class _HeldWrites(BlockStore):
    """``store``, whose writes hold their ranges until the next step's forward pass has run."""

    def __init__(self, store: BlockStore, progress: _Progress) -> None:
        self._store = store
        self._progress = progress
        self.medium = store.medium

    def write_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        commit_gate: CacheWrites | None = None,
    ) -> list[bool]:
        # Payload ranges only: the header is the worker's own buffer.
        before = [[bytes(part) for part in ranges[1:]] for ranges in ranges_per_key]
        progress = self._progress
        with progress.changed:
            step = progress.steps
            progress.changed.wait_for(
                lambda: progress.steps > step or progress.draining or progress.waits > 0,
                HOLD_LIMIT_S,
            )
        changed = [
            [bytes(part) for part in ranges[1:]] != saved
            for ranges, saved in zip(ranges_per_key, before, strict=True)
        ]
        results = self._store.write_ranges(keys, ranges_per_key, commit_gate)
        # A save whose blocks changed under it may write them, never commit them.
        CHANGED_UNDER_SAVE.extend(
            key for key, moved, ok in zip(keys, changed, results, strict=True) if moved and ok
        )
        return results

    def count_prefix(self, keys: Sequence[str]) -> int:
        return self._store.count_prefix(keys)

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        return self._store.put(keys, entries)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return self._store.get_into(keys, buffers)

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        return (yield from self._store.read_into_ranges(keys, ranges_per_key, writes))

    def discard(self, keys: Sequence[str]) -> None:
        self._store.discard(keys)

    def take_removed_keys(self) -> list[str]:
        return self._store.take_removed_keys()

    def close(self) -> None:
        self._store.close()


class HeldWritesDirectory(DirectoryMedium):
    """The directory medium whose store's writes are held (see the module)."""

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        self.progress = _Progress()

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        return _HeldWrites(super().create_store(options), self.progress)


class HeldWritesConnector(SharedStorageConnector):
    """Shared storage whose writes are held (see the module); counts what changed under them."""

    default_medium = f"{__name__}:{HeldWritesDirectory.__name__}"

    @property
    def _progress(self) -> _Progress:
        medium = self.medium
        assert isinstance(medium, HeldWritesDirectory)
        return medium.progress

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
        handler = self._worker.handler
        assert isinstance(handler, StoreTransferHandler)
        release_saves_reading = handler.release_saves_reading

        def waited_for(request_ids: Iterable[str], block_ids: Set[int]) -> list[BlockTransfer]:
            request_ids = tuple(request_ids)
            if not (request_ids or block_ids):
                return release_saves_reading(request_ids, block_ids)
            # The engine waits for saves before its forward pass: held writes go
            # on now (those waited for may be queued behind them).
            with self._progress.changed:
                self._progress.waits += 1
                self._progress.changed.notify_all()
            try:
                return release_saves_reading(request_ids, block_ids)
            finally:
                with self._progress.changed:
                    self._progress.waits -= 1

        handler.release_saves_reading = waited_for  # type: ignore[method-assign]

    def wait_for_save(self) -> None:
        # Called after the forward pass: writes held since an earlier step go on.
        with self._progress.changed:
            self._progress.steps += 1
            self._progress.changed.notify_all()
        super().wait_for_save()

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        self._drain()
        return super().wait_for_pending_saves(timeout_s)

    def shutdown(self) -> None:
        self._drain()
        super().shutdown()

    def _drain(self) -> None:
        """No next step will come: held writes go on."""
        with self._progress.changed:
            self._progress.draining = True
            self._progress.changed.notify_all()


@pytest.mark.parametrize("model", ["full-attention", "tiny-hybrid"])
def test_preempted_and_finished_requests_blocks_stay_unchanged_until_their_saves_end(
    tmp_path: pathlib.Path, model: str
) -> None:
    CHANGED_UNDER_SAVE.clear()
    # So few blocks that running requests are preempted and their blocks reused;
    # on the hybrid model, blocks also leave the sliding window (8 tokens) as
    # the requests grow, and are given out again.
    small = tiny_config(num_gpu_blocks=24)
    if model == "tiny-hybrid":
        small = apply_preset(small, "tiny-hybrid")
    requests = workload(num_requests=8, prompt_len=30)
    expected = tokens(generate_without(small, requests))
    config = with_connector(
        small,
        "HeldWritesConnector",
        {"shared_storage_path": str(tmp_path), "max_save_bytes_in_flight": "64MiB"},
        module_path=__name__,
    )
    with LLMEngine(config) as engine:
        cold = engine.generate(requests)
        engine.wait_for_saves()
        engine.reset_prefix_cache()
        warm = engine.generate(renamed(requests, "-warm"))

    if model == "full-attention":
        assert sum(output.num_preemptions for output in cold) > 0
    assert CHANGED_UNDER_SAVE == []
    assert tokens(cold) == expected
    assert tokens(warm) == expected
    assert sum(output.num_load_failures for output in warm) == 0


def test_a_finished_request_keeps_its_blocks_until_its_saves_are_written(
    shared_storage_pair: PairFactory,
) -> None:
    producer = shared_storage_pair(seed=1)
    request = make_request("p", PROMPT, BLOCK)
    producer.prefill(request, PRODUCER_BLOCKS)

    keep, _ = producer.scheduler.request_finished(request, PRODUCER_BLOCKS)

    assert keep is True
    producer.step(SchedulerOutput(finished_req_ids={"p"}), {"p"})
    producer.step_until(lambda: "p" in producer.finished_sending)
    # Reported only once nothing of it is left to write.
    assert producer.worker.wait_for_pending_saves(0)


def test_a_request_with_nothing_to_save_is_freed_at_once(
    shared_storage_pair: PairFactory,
) -> None:
    consumer = shared_storage_pair(seed=1, kv_role="kv_consumer")
    request = make_request("c", PROMPT, BLOCK)
    consumer.prefill(request, PRODUCER_BLOCKS)

    keep, _ = consumer.scheduler.request_finished(request, PRODUCER_BLOCKS)

    assert keep is False


class _HeldForever(BlockStore):
    """Entries in a dict; every write waits for :attr:`release` (set by the test at its end)."""

    medium = "memory"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.stored: list[str] = []

    def count_prefix(self, keys: Sequence[str]) -> int:
        return 0

    def write_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        commit_gate: CacheWrites | None = None,
    ) -> list[bool]:
        self.entered.set()
        self.release.wait(HOLD_LIMIT_S)
        return super().write_ranges(keys, ranges_per_key, commit_gate)

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        self.stored.extend(keys)
        return [True] * len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return [None] * len(keys)


def test_the_saves_reading_blocks_given_out_again_are_released_without_waiting_for_them() -> None:
    store = _HeldForever()
    counters = Counters()
    caches = layout_caches(LAYOUT, seed=1)
    worker = DrivenHandler(
        StoreTransferHandler(
            store=store,
            layouts=(LAYOUT,),
            memories=(BlockMemory(caches, LAYOUT, sorted(caches)),),
            io_threads=1,
            batch_blocks=2,
            counters=counters,
            medium="memory",
            max_save_bytes=4 * LAYOUT.entry_bytes,
            transfer_timeout_s=HOLD_LIMIT_S,
        )
    )
    try:
        # "p" holds the one save thread in its write; "q" waits for the thread.
        worker.save([BlockTransfer(request_id="p", block_ids=(0, 1), block_hashes=HASHES)])
        assert store.entered.wait(HOLD_LIMIT_S)
        worker.save([BlockTransfer(request_id="q", block_ids=(2, 3), block_hashes=HASHES)])
        # Blocks 4 and 5 are no save's: nothing is released.
        worker.release_saves_reading((), {4, 5})
        assert "saves_released" not in counters.take()
        # Block 3 was given out again: "q", not started, is cancelled.
        worker.release_saves_reading((), {3, 5})
        assert counters.take() == {"saves_released": 2}
        assert not worker.is_busy("q")
        assert worker.is_busy("p")
        # Block 1 too: "p" is given up on while its write is still held.
        worker.release_saves_reading((), {1})
        assert not worker.is_busy("p")
    finally:
        store.release.set()
    wait_until(worker.handler.idle, "the held write to return")
    # Its gate closed before it copied a byte: nothing of it is stored.
    assert store.stored == []
    assert counters.take()["saves_released"] == 2
    assert worker.take_events() == []
    worker.close()


def test_each_steps_metadata_names_the_blocks_given_out_since_the_last(
    shared_storage_pair: PairFactory,
) -> None:
    pair = shared_storage_pair(seed=1)
    request = make_request("p", PROMPT, BLOCK)
    pair.scheduler.get_num_new_matched_tokens(request, 0)
    pair.scheduler.update_state_after_alloc(request, KVCacheBlocks((PRODUCER_BLOCKS,)), 0)
    metadata = pair.scheduler.build_connector_meta(SchedulerOutput())
    assert isinstance(metadata, OffloadMetadata)
    assert metadata.new_block_ids == frozenset(PRODUCER_BLOCKS)
    again = pair.scheduler.build_connector_meta(SchedulerOutput())
    assert isinstance(again, OffloadMetadata)
    assert again.new_block_ids == frozenset()


class _WritesWhenLetGo(DirectoryBlockStore):
    """A directory whose writes, once :attr:`hold` is set, start only when :attr:`go` is set."""

    def __init__(self, root: pathlib.Path, entry_bytes: int) -> None:
        super().__init__(root, entry_bytes=entry_bytes)
        self.hold = False
        self.entered = threading.Event()
        self.go = threading.Event()

    def write_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        commit_gate: CacheWrites | None = None,
    ) -> list[bool]:
        if self.hold:
            self.entered.set()
            self.go.wait(HOLD_LIMIT_S)
        return super().write_ranges(keys, ranges_per_key, commit_gate)


def _directory_worker(
    store: BlockStore, caches: dict[str, Any], counters: Counters, timeout_s: float
) -> DrivenHandler[StoreTransferHandler]:
    handler = StoreTransferHandler(
        store=store,
        layouts=(LAYOUT,),
        memories=(BlockMemory(caches, LAYOUT, sorted(caches)),),
        io_threads=1,
        batch_blocks=1,
        counters=counters,
        medium="disk",
        max_save_bytes=4 * LAYOUT.entry_bytes,
        transfer_timeout_s=timeout_s,
    )
    return DrivenHandler(handler)


def test_a_save_given_up_on_whose_block_is_overwritten_never_replaces_the_stored_entry(
    tmp_path: pathlib.Path,
) -> None:
    store = _WritesWhenLetGo(tmp_path, LAYOUT.entry_bytes)
    good = layout_caches(LAYOUT, seed=7)
    other = _directory_worker(store, good, Counters(), HOLD_LIMIT_S)
    other.save([BlockTransfer(request_id="o", block_ids=(0,), block_hashes=HASHES[:1])])
    assert other.wait_for_saves(HOLD_LIMIT_S)
    other.close()
    # This engine saves the same block (same KV, same hash); its write is held.
    caches = {name: cache.clone() for name, cache in good.items()}
    worker = _directory_worker(store, caches, Counters(), 0.2)
    store.hold = True
    worker.save([BlockTransfer(request_id="p", block_ids=(0,), block_hashes=HASHES[:1])])
    assert store.entered.wait(HOLD_LIMIT_S)

    # Block 0 was given to another request: the save is given up on, then the block written.
    worker.release_saves_reading((), {0})
    for cache in caches.values():
        cache[:, 0] = 123.0
    store.go.set()
    wait_until(worker.handler.idle, "the given-up save to return")

    assert not any(isinstance(event, BlockStored) for event in worker.take_events())
    loaded = layout_caches(LAYOUT, None)
    reader = _directory_worker(store, loaded, Counters(), HOLD_LIMIT_S)
    reader.start_loads([BlockTransfer(request_id="c", block_ids=(2,), block_hashes=HASHES[:1])], [])
    assert reader.take_load_errors() == set()
    assert all(torch.equal(loaded[name][:, 2], good[name][:, 0]) for name in good)
    reader.close()
    worker.close()
