"""How a store worker splits a load into runs, and gives their staging slots back.

A load is one ``read_each`` per run, so a store that talks to a server can
ask for later entries while the worker verifies and scatters earlier ones. A
transfer is shared between the I/O threads (no more ways than there are
cores) in runs of at least ``batch_blocks``; a run gives each slot back as
soon as its entry is in the cache, so a transfer larger than the staging
buffers streams through them.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Generator, Sequence

import pytest
import torch

from kvwire.connectors import store_worker as store_worker_module
from kvwire.connectors.block_format import BlockLayout
from kvwire.connectors.counters import Counters
from kvwire.connectors.file_store import DirectoryBlockStore
from kvwire.connectors.paged_cache import PagedKVCaches
from kvwire.connectors.staging import StagingBuffers
from kvwire.connectors.store_worker import BlockTransfer, StoreWorker
from tests.connectors.store_workers import layout_caches

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
NUM_BLOCKS = 16
HASHES = tuple(bytes([index + 1]) * 32 for index in range(NUM_BLOCKS // 2))


class RecordingStore(DirectoryBlockStore):
    """A real directory store that notes how many keys each ``read_each`` asks for.

    With ``hold_after_first`` set, every read stops after its first entry
    until ``release`` is set, the way a slow server would.
    """

    def __init__(self, root: pathlib.Path, hold_after_first: bool = False) -> None:
        super().__init__(root, entry_bytes=LAYOUT.entry_bytes)
        self.read_sizes: list[int] = []
        self.hold_after_first = hold_after_first
        self.release = threading.Event()

    def read_each(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> Generator[tuple[int, int | None], None, None]:
        self.read_sizes.append(len(keys))
        for index, size in super().read_each(keys, buffers):
            yield index, size
            if index == 0 and self.hold_after_first:
                assert self.release.wait(30), "the test never let the read go on"


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    return layout_caches(LAYOUT, seed, NUM_BLOCKS)


def _worker(
    store: DirectoryBlockStore,
    caches: dict[str, torch.Tensor],
    *,
    slots: int,
    io_threads: int,
    batch_blocks: int,
) -> StoreWorker:
    return StoreWorker(
        store=store,
        layouts=(LAYOUT,),
        caches=(PagedKVCaches(caches, LAYOUT, sorted(caches)),),
        staging=StagingBuffers(LAYOUT, slots),
        io_threads=io_threads,
        batch_blocks=batch_blocks,
        counters=Counters(),
        medium="test",
    )


def _saved_caches(store: DirectoryBlockStore) -> dict[str, torch.Tensor]:
    """A producer's caches; its first ``len(HASHES)`` blocks are now in ``store``."""
    caches = _caches(seed=3)
    producer = _worker(store, caches, slots=len(HASHES), io_threads=1, batch_blocks=len(HASHES))
    producer.save([BlockTransfer("p", tuple(range(len(HASHES))), HASHES)])
    assert producer.wait_for_saves(30)
    producer.close()
    return caches


# The consumer loads the saved blocks into its last len(HASHES) blocks.
TARGETS = tuple(range(NUM_BLOCKS - len(HASHES), NUM_BLOCKS))


def _assert_loaded(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, TARGETS[0] :], cache[:, : len(HASHES)])


@pytest.mark.parametrize(
    ("io_threads", "cores", "batch_blocks", "read_sizes"),
    [
        (1, 8, 1, [8]),  # one thread: the whole transfer in one read
        (2, 8, 1, [4, 4]),  # shared between the threads
        (4, 8, 1, [2, 2, 2, 2]),
        (4, 2, 1, [4, 4]),  # but no more ways than there are cores
        (2, 8, 8, [8]),  # never runs shorter than batch_blocks
        (4, 8, 3, [3, 3, 2]),
    ],
)
def test_a_transfer_is_shared_between_the_threads_in_runs_of_at_least_batch_blocks(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    io_threads: int,
    cores: int,
    batch_blocks: int,
    read_sizes: list[int],
) -> None:
    monkeypatch.setattr(store_worker_module, "usable_cores", lambda: cores)
    store = RecordingStore(tmp_path)
    saved = _saved_caches(store)
    loaded = _caches(seed=None)
    worker = _worker(store, loaded, slots=16, io_threads=io_threads, batch_blocks=batch_blocks)

    worker.start_loads([BlockTransfer("c", TARGETS, HASHES)], [])

    assert worker.take_load_errors() == set()
    worker.close()
    assert sorted(store.read_sizes, reverse=True) == read_sizes
    _assert_loaded(saved, loaded)


def test_a_transfer_larger_than_the_staging_buffers_streams_through_them(
    tmp_path: pathlib.Path,
) -> None:
    store = RecordingStore(tmp_path)
    saved = _saved_caches(store)
    loaded = _caches(seed=None)
    worker = _worker(store, loaded, slots=3, io_threads=2, batch_blocks=1)

    worker.start_loads([], [BlockTransfer("c", TARGETS, HASHES)])

    worker.wait_for_loads()
    while worker.is_loading("c"):
        threading.Event().wait(0.01)
    assert worker.take_finished_loads() == {"c"}
    assert worker.take_load_errors() == set()
    worker.close()
    assert sum(store.read_sizes) == len(HASHES)
    assert max(store.read_sizes) <= 3
    _assert_loaded(saved, loaded)


def test_a_run_gives_a_slot_back_as_soon_as_its_entry_is_in_the_cache(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_worker_module, "usable_cores", lambda: 2)
    store = RecordingStore(tmp_path, hold_after_first=True)
    saved = _saved_caches(store)
    # Scatter one entry at a time, so each slot is free to go back at once.
    monkeypatch.setattr(store_worker_module, "CACHE_CHUNK_BYTES", 1)
    loaded = _caches(seed=None)
    # Two slots, and the first run takes both; the second run needs one of them.
    worker = _worker(store, loaded, slots=2, io_threads=2, batch_blocks=2)
    submitted = threading.Event()

    def submit() -> None:
        worker.start_loads([BlockTransfer("c", TARGETS[:3], HASHES[:3])], [])
        submitted.set()

    submitter = threading.Thread(target=submit)
    submitter.start()

    # The first run holds after its first entry, with its second slot still
    # in use: the second run can only have started on the slot given back.
    assert submitted.wait(30)
    store.release.set()
    submitter.join(30)
    assert worker.take_load_errors() == set()
    worker.close()
    assert store.read_sizes == [2, 1]
    for name, cache in saved.items():
        assert torch.equal(loaded[name][:, TARGETS[0] : TARGETS[0] + 3], cache[:, :3])
