"""How a store worker splits a load into runs.

A load is one ``read_into_ranges`` per run, so a store that talks to a
server can ask for later entries while the worker verifies earlier ones. A
transfer is shared between the I/O threads (no more ways than there are
cores) in runs of at least ``batch_blocks``.
"""

from __future__ import annotations

import pathlib
from collections.abc import Generator, Sequence

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.memory import BlockMemory
from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.counters import Counters
from kvwire.media.store import _handler as store_worker_module
from kvwire.media.store._handler import StoreTransferHandler
from kvwire.media.store.base import CacheWrites
from kvwire.media.store.directory.block_store import DirectoryBlockStore
from tests.support.media import DrivenHandler
from tests.support.stores import layout_caches

LAYOUT = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
NUM_BLOCKS = 16
HASHES = tuple(bytes([index + 1]) * 32 for index in range(NUM_BLOCKS // 2))


class RecordingStore(DirectoryBlockStore):
    """A real directory store that notes how many keys each ``read_into_ranges`` asks for."""

    def __init__(self, root: pathlib.Path) -> None:
        super().__init__(root, entry_bytes=LAYOUT.entry_bytes)
        self.read_sizes: list[int] = []

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        self.read_sizes.append(len(keys))
        return (yield from super().read_into_ranges(keys, ranges_per_key, writes))


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    return layout_caches(LAYOUT, seed, NUM_BLOCKS)


def _worker(
    store: DirectoryBlockStore,
    caches: dict[str, torch.Tensor],
    *,
    io_threads: int,
    batch_blocks: int,
) -> DrivenHandler[StoreTransferHandler]:
    handler = StoreTransferHandler(
        store=store,
        layouts=(LAYOUT,),
        memories=(BlockMemory(caches, LAYOUT, sorted(caches)),),
        io_threads=io_threads,
        batch_blocks=batch_blocks,
        max_save_bytes=NUM_BLOCKS * LAYOUT.entry_bytes,
        counters=Counters(),
        medium="test",
    )
    return DrivenHandler(handler)


def _saved_caches(store: DirectoryBlockStore) -> dict[str, torch.Tensor]:
    """A producer's caches; its first ``len(HASHES)`` blocks are now in ``store``."""
    caches = _caches(seed=3)
    producer = _worker(store, caches, io_threads=1, batch_blocks=len(HASHES))
    producer.save(
        [BlockTransfer(request_id="p", block_ids=tuple(range(len(HASHES))), block_hashes=HASHES)]
    )
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
    worker = _worker(store, loaded, io_threads=io_threads, batch_blocks=batch_blocks)

    worker.start_loads([BlockTransfer(request_id="c", block_ids=TARGETS, block_hashes=HASHES)], [])

    assert worker.take_load_errors() == set()
    worker.close()
    assert sorted(store.read_sizes, reverse=True) == read_sizes
    _assert_loaded(saved, loaded)
