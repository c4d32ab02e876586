"""A block's byte ranges in the KV cache: the entry payload's bytes, in its order."""

from __future__ import annotations

import re

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.memory import BlockMemory
from kvwire.blocks.paged_cache import PagedKVCaches

NUM_BLOCKS = 6
LAYOUTS = {
    (cache_layout, dtype): BlockLayout(
        num_layers=3,
        block_size=4,
        num_kv_heads=2,
        head_size=8,
        dtype=dtype,
        cache_layout=cache_layout,
    )
    for cache_layout in ("kvwire", "vllm_cpu")
    for dtype in ("float32", "bfloat16", "float16", "float8_e4m3fn")
}
TORCH = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def caches(layout: BlockLayout) -> dict[str, torch.Tensor]:
    if layout.cache_layout == "vllm_cpu":
        shape: tuple[int, ...] = (
            NUM_BLOCKS,
            layout.num_kv_heads,
            layout.block_size,
            2 * layout.head_size,
        )
    else:
        shape = (2, NUM_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_size)
    generator = torch.Generator().manual_seed(0)
    itemsize = TORCH[layout.dtype].itemsize
    # Random bytes of every value, NaN patterns included: ranges are compared as bytes.
    raw_shape = (*shape[:-1], shape[-1] * itemsize)
    return {
        f"layers.{i}.attn": torch.randint(
            0, 256, raw_shape, dtype=torch.uint8, generator=generator
        ).view(TORCH[layout.dtype])
        for i in range(3)
    }


@pytest.mark.parametrize("key", list(LAYOUTS), ids=lambda key: f"{key[0]}-{key[1]}")
def test_a_blocks_ranges_are_the_bytes_gather_many_copies_in_payload_order(key):
    layout = LAYOUTS[key]
    source = caches(layout)
    order = ["layers.2.attn", "layers.0.attn", "layers.1.attn"]
    memory = BlockMemory(source, layout, order)
    entries = torch.zeros(1, *layout.shape, dtype=TORCH[layout.dtype])
    for block_id in (0, 3, NUM_BLOCKS - 1):
        PagedKVCaches(source, layout, order).gather_many([block_id], [0], entries)
        ranges = memory.ranges(block_id)
        assert (
            b"".join(bytes(part) for part in ranges)
            == entries[0].view(torch.uint8).numpy().tobytes()
        )
        assert sum(len(part) for part in ranges) == layout.payload_bytes


@pytest.mark.parametrize("key", list(LAYOUTS), ids=lambda key: f"{key[0]}-{key[1]}")
def test_writes_through_the_ranges_land_in_that_blocks_elements_only(key):
    layout = LAYOUTS[key]
    target = caches(layout)
    before = {name: tensor.clone() for name, tensor in target.items()}
    memory = BlockMemory(target, layout, sorted(target))
    entries = torch.zeros(1, *layout.shape, dtype=TORCH[layout.dtype])
    PagedKVCaches(caches(layout), layout, sorted(target)).gather_many([1], [0], entries)
    payload = memoryview(entries[0].view(torch.uint8).numpy().tobytes())
    offset = 0
    for part in memory.ranges(4):
        part[:] = payload[offset : offset + len(part)]
        offset += len(part)
    written = torch.zeros(1, *layout.shape, dtype=TORCH[layout.dtype])
    PagedKVCaches(target, layout, sorted(target)).gather_many([4], [0], written)
    assert torch.equal(written.view(torch.uint8), entries.view(torch.uint8))
    block_dim = 0 if layout.cache_layout == "vllm_cpu" else 1
    for name, tensor in target.items():
        others = [b for b in range(NUM_BLOCKS) if b != 4]
        index = torch.tensor(others)
        assert torch.equal(
            tensor.index_select(block_dim, index).view(torch.uint8),
            before[name].index_select(block_dim, index).view(torch.uint8),
        )


@pytest.mark.parametrize("block_id", [-1, NUM_BLOCKS, 100])
def test_a_block_id_outside_the_cache_is_refused(block_id):
    layout = LAYOUTS["kvwire", "float32"]
    memory = BlockMemory(caches(layout), layout)
    with pytest.raises(IndexError, match=re.escape(f"block id {block_id} is outside the cache")):
        memory.ranges(block_id)


def test_caches_not_contiguous_after_the_block_dimension_are_refused():
    layout = LAYOUTS["kvwire", "float32"]
    strided = {name: torch.zeros(2, NUM_BLOCKS, 2, 4, 8).transpose(2, 3) for name in caches(layout)}
    with pytest.raises(ValueError, match="expected the dimensions after the block dimension"):
        BlockMemory(strided, layout)


def test_the_paged_cache_checks_apply():
    layout = LAYOUTS["kvwire", "float32"]
    wrong = {name: cache.half() for name, cache in caches(layout).items()}
    with pytest.raises(
        ValueError, match=re.escape("has dtype torch.float16, the model config says float32")
    ):
        BlockMemory(wrong, layout)


def test_an_error_shows_a_layer_name_bounded():
    # A layer name comes from the model: an error line quotes its start only.
    layout = LAYOUTS["kvwire", "float32"]
    strided = {
        f"{'x' * 100_000}.{i}": torch.zeros(2, NUM_BLOCKS, 2, 4, 8).transpose(2, 3)
        for i in range(3)
    }
    with pytest.raises(ValueError, match="expected the dimensions after") as refused:
        BlockMemory(strided, layout)
    assert len(str(refused.value)) < 400
