"""Zeroing failed loads' blocks: the whole block of every layer of its group, nothing else."""

from __future__ import annotations

import pytest
import torch

from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.scrub import BlockScrubber

NUM_BLOCKS = 6


def kvwire_caches(*names: str) -> dict[str, torch.Tensor]:
    """kvwire's layout, [2, num_blocks, block_size, heads, head_size], filled with NaN."""
    return {name: torch.full((2, NUM_BLOCKS, 4, 2, 8), float("nan")) for name in names}


def vllm_cpu_caches(*names: str) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout, [num_blocks, heads, block_size, 2 * head_size], filled with NaN."""
    return {name: torch.full((NUM_BLOCKS, 2, 4, 16), float("nan")) for name in names}


def group(index: int, *layer_names: str) -> CacheGroup:
    return CacheGroup(index=index, layer_names=layer_names, block_size=4)


def zero_blocks(cache: torch.Tensor, block_dim: int) -> list[int]:
    return [
        block for block in range(NUM_BLOCKS) if bool((cache.select(block_dim, block) == 0).all())
    ]


def test_a_scrubbed_block_is_zero_in_keys_and_values_of_every_layer_and_no_other_block_changes():
    caches = kvwire_caches("a", "b")
    scrubber = BlockScrubber(caches, [group(0, "a", "b")], "kvwire")

    assert scrubber.scrub(0, [2, 4]) == 2

    for cache in caches.values():
        assert zero_blocks(cache, 1) == [2, 4]
        untouched = [block for block in range(NUM_BLOCKS) if block not in (2, 4)]
        assert bool(cache[:, untouched].isnan().all())


def test_vllm_cpu_layout_blocks_are_scrubbed_whole():
    caches = vllm_cpu_caches("a")
    scrubber = BlockScrubber(caches, [group(0, "a")], "vllm_cpu")

    scrubber.scrub(0, [1])

    assert zero_blocks(caches["a"], 0) == [1]


def test_only_the_failed_groups_layers_are_scrubbed():
    caches = kvwire_caches("full", "sliding")
    scrubber = BlockScrubber(caches, [group(0, "full"), group(1, "sliding")], "kvwire")

    scrubber.scrub(1, [3])

    assert zero_blocks(caches["sliding"], 1) == [3]
    assert zero_blocks(caches["full"], 1) == []


def test_a_layer_no_group_names_is_scrubbed_for_every_group():
    caches = kvwire_caches("named", "stray")
    scrubber = BlockScrubber(caches, [group(0, "named")], "kvwire")

    scrubber.scrub(0, [0])

    assert zero_blocks(caches["stray"], 1) == [0]


def test_a_group_with_no_local_layers_scrubs_nothing_and_an_unknown_group_scrubs_every_layer():
    # A pipeline stage registers some layers only.
    caches = kvwire_caches("a")
    scrubber = BlockScrubber(caches, [group(0, "a"), group(1, "elsewhere")], "kvwire")

    assert scrubber.scrub(1, [2]) == 0
    assert zero_blocks(caches["a"], 1) == []
    assert scrubber.scrub(7, [2]) == 1
    assert zero_blocks(caches["a"], 1) == [2]


def test_ids_outside_the_cache_are_skipped():
    caches = kvwire_caches("a")
    scrubber = BlockScrubber(caches, [group(0, "a")], "kvwire")

    assert scrubber.scrub(0, [-1, NUM_BLOCKS, 5]) == 1
    assert zero_blocks(caches["a"], 1) == [5]


def test_an_unknown_cache_layout_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"'nhd'.*\['kvwire', 'vllm_cpu'\]"):
        BlockScrubber(kvwire_caches("a"), [group(0, "a")], "nhd")
