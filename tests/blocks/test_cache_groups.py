"""Which blocks each KV cache group needs, and the groups read from a KVCacheConfig."""

from __future__ import annotations

import pytest

from kvwire.blocks.groups import CacheGroup, cache_groups, layers_per_group
from kvwire.config.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

SPEC = {"block_size": 16, "num_kv_heads": 2, "head_size": 8}


def _config(*groups: tuple[list[str], int | None]) -> KVCacheConfig:
    specs = [
        KVCacheGroupSpec(
            layer_names=names,
            kv_cache_spec=(
                FullAttentionSpec(**SPEC)
                if window is None
                else SlidingWindowSpec(**SPEC, sliding_window=window)
            ),
        )
        for names, window in groups
    ]
    return KVCacheConfig(num_blocks=8, kv_cache_groups=specs)


@pytest.mark.parametrize(
    ("window", "expected"),
    # The next token attends to window - 1 earlier tokens: ceil((window - 1) / 16) blocks.
    [(1, 0), (2, 1), (16, 1), (17, 1), (18, 2), (64, 4), (65, 4), (66, 5)],
)
def test_window_blocks_cover_the_tokens_the_next_token_attends_to(
    window: int, expected: int
) -> None:
    group = CacheGroup(index=1, layer_names=("a",), block_size=16, sliding_window=window)
    assert group.window_blocks == expected


def test_a_full_group_needs_every_block_and_a_sliding_one_its_window() -> None:
    full = CacheGroup(index=0, layer_names=("a",), block_size=16)
    sliding = CacheGroup(index=1, layer_names=("b",), block_size=16, sliding_window=64)
    assert full.needed_positions(10) == range(10)
    assert sliding.needed_positions(10) == range(6, 10)
    assert sliding.needed_positions(3) == range(3)


def test_groups_come_in_config_order_with_their_windows_and_distinct_names() -> None:
    groups = cache_groups(_config((["l1", "l3"], None), (["l0", "l2"], 64)))
    assert [(g.index, g.layer_names, g.sliding_window) for g in groups] == [
        (0, ("l1", "l3"), None),
        (1, ("l0", "l2"), 64),
    ]
    assert groups[0].name != groups[1].name
    assert layers_per_group(groups) == 2


def test_groups_of_different_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_groups: groups have 1, 2 layers"):
        cache_groups(_config((["l1"], None), (["l0", "l2"], 64)))


def test_a_config_without_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_groups is empty"):
        cache_groups(KVCacheConfig(num_blocks=8))
