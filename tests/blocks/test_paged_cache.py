"""Block copies between the paged caches and cross-layer entries."""

from __future__ import annotations

import re

import pytest
import torch

from kvwire.blocks.format import BlockLayout
from kvwire.blocks.paged_cache import PagedKVCaches
from tests.support.pairs import build_connector

LAYOUT = BlockLayout(num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")


def caches(num_blocks: int = 10) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"layers.{i}.attn": torch.randn(2, num_blocks, 4, 2, 8, generator=generator)
        for i in range(3)
    }


@pytest.mark.parametrize(
    ("block_ids", "slots"),
    [([2, 3, 4, 5], [0, 1, 2, 3]), ([7, 1, 8, 9], [3, 0, 1, 2]), ([5], [2])],
    ids=["one-run", "scattered", "single"],
)
def test_gathered_blocks_hold_every_layer_in_order_and_scatter_back(block_ids, slots):
    source = caches()
    paged = PagedKVCaches(source, LAYOUT, sorted(source))
    entries = torch.zeros(4, *LAYOUT.shape)
    paged.gather_many(block_ids, slots, entries)
    for block_id, slot in zip(block_ids, slots, strict=True):
        for layer, name in enumerate(sorted(source)):
            assert torch.equal(entries[slot, layer], source[name][:, block_id])
    target = caches()
    for cache in target.values():
        cache.zero_()
    PagedKVCaches(target, LAYOUT, sorted(target)).scatter_many(entries, slots, block_ids)
    for name in source:
        assert torch.equal(target[name][:, block_ids], source[name][:, block_ids])


def test_the_engines_layer_order_decides_the_cross_layer_order():
    source = caches()
    order = ["layers.2.attn", "layers.0.attn", "layers.1.attn"]
    entries = torch.zeros(1, *LAYOUT.shape)
    PagedKVCaches(source, LAYOUT, order).gather_many([4], [0], entries)
    assert torch.equal(entries[0, 0], source["layers.2.attn"][:, 4])


def test_a_block_id_outside_the_cache_is_an_error_not_a_silent_no_op():
    paged = PagedKVCaches(caches(), LAYOUT)
    with pytest.raises(IndexError, match=r"block id 10 is outside the cache \(0..9\)"):
        paged.gather_many([10], [0], torch.zeros(1, *LAYOUT.shape))


def test_the_cache_holds_block_ids_only_inside_it():
    paged = PagedKVCaches(caches(), LAYOUT)
    assert paged.holds_block_ids([0, 9, 4]) and paged.holds_block_ids([])
    assert not paged.holds_block_ids([3, 10]) and not paged.holds_block_ids([-1, 2])


def test_caches_of_another_dtype_are_refused():
    wrong = {name: cache.half() for name, cache in caches().items()}
    with pytest.raises(
        ValueError, match=re.escape("has dtype torch.float16, the model config says float32")
    ):
        PagedKVCaches(wrong, LAYOUT)


def test_a_missing_layer_is_refused():
    two = dict(list(caches().items())[:2])
    with pytest.raises(ValueError, match="got 2 layers, the model config says num_layers=3"):
        PagedKVCaches(two, LAYOUT)


def test_a_cache_config_that_disagrees_with_the_engine_config_is_refused():
    from kvwire.config.kv_cache import build_full_attention_kv_cache_config
    from kvwire.connectors.offload import CPUOffloadConnector
    from kvwire.interface.base import KVConnectorRole
    from tests.support.pairs import engine_config

    config = engine_config("CPUOffloadConnector", {"cpu_pool_bytes": "1MiB"}, head_size=16)
    other = build_full_attention_kv_cache_config(
        num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_size=8, dtype="float32"
    )
    with pytest.raises(ValueError) as raised:
        build_connector(CPUOffloadConnector, config, KVConnectorRole.WORKER, other)
    assert str(raised.value) == (
        "kv_cache_config: a group has (block_size, num_kv_heads, head_size, dtype) = "
        "(4, 2, 8, 'float32'), the engine config says (4, 2, 16, 'float32')"
    )
