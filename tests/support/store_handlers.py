"""Store workers over real paged caches, for tests of the worker-side data path."""

from __future__ import annotations

import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.memory import BlockMemory
from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.counters import Counters
from kvwire.media.store._handler import StoreTransferHandler
from kvwire.media.store.base import BlockStore
from tests.support.driven_handlers import DrivenHandler

NUM_BLOCKS = 4


def layout_caches(
    layout: BlockLayout, seed: int | None, num_blocks: int = NUM_BLOCKS
) -> dict[str, torch.Tensor]:
    """Paged caches of ``num_blocks`` blocks in ``layout``: zeros, or random from ``seed``."""
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size)
    if seed is None:
        return {f"layers.{i}": torch.zeros(shape) for i in range(layout.num_layers)}
    generator = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}": torch.randn(shape, generator=generator) for i in range(layout.num_layers)
    }


def store_worker(
    store: BlockStore, layout: BlockLayout, caches: dict[str, torch.Tensor]
) -> DrivenHandler[StoreTransferHandler]:
    """A one-thread worker, keyed by the layout's own keys, driven as the connector drives it."""
    handler = StoreTransferHandler(
        store=store,
        layouts=(layout,),
        memories=(BlockMemory(caches, layout, sorted(caches)),),
        io_threads=1,
        batch_blocks=2,
        max_save_bytes=2 * layout.entry_bytes,
        counters=Counters(),
        medium="test",
    )
    return DrivenHandler(handler)


HASHES = (b"\x01" * 32, b"\x02" * 32)
"""The block hashes blocks 0 and 1 are saved under, and blocks 2 and 3 loaded from."""


def save_blocks_0_and_1(
    store: BlockStore, layout: BlockLayout, seed: int
) -> dict[str, torch.Tensor]:
    """A producer's random caches; its blocks 0 and 1 are now in ``store`` under ``HASHES``."""
    caches = layout_caches(layout, seed=seed)
    producer = store_worker(store, layout, caches)
    producer.save([BlockTransfer(request_id="p", block_ids=(0, 1), block_hashes=HASHES)])
    assert producer.wait_for_saves(30)
    producer.close()
    return caches


def load_into_blocks_2_and_3(
    store: BlockStore, layout: BlockLayout
) -> tuple[dict[str, torch.Tensor], set[int]]:
    """A consumer's caches after loading ``HASHES`` into blocks 2 and 3, and its load errors."""
    caches = layout_caches(layout, seed=None)
    consumer = store_worker(store, layout, caches)
    consumer.start_loads([BlockTransfer(request_id="c", block_ids=(2, 3), block_hashes=HASHES)], [])
    errors = consumer.take_load_errors()
    consumer.close()
    return caches, errors
