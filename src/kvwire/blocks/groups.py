"""The KV cache groups a connector serves, and which of a request's blocks each one needs.

A hybrid model's `KVCacheConfig` has several groups: full-attention layers
in one, sliding-window layers in another. Each group has its own block
table; a request's blocks are position-aligned in every group (the block at
position `i` holds tokens `[i * block_size, (i + 1) * block_size)`, whose
hash is `request.block_hashes[i]`), but a sliding-window group keeps only
the blocks its window still reaches: the others are the null block.

The token at position `p` of a sliding-window layer attends to positions
`[p - sliding_window + 1, p]`. A prefix of `n` full blocks is thus usable
in a sliding-window group when the group holds its last
`ceil((sliding_window - 1) / block_size)` blocks; a full-attention group
needs all `n`. A connector moves only those, and a lookup's hit is the
longest prefix usable in every group.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvwire.config.kv_cache import KVCacheConfig, SlidingWindowSpec

NULL_BLOCK_ID = 0
"""The block id a hybrid engine gives positions that left a sliding window: never moved."""


@attrs.frozen
class CacheGroup:
    """One KV cache group as a connector sees it: its layers and its window, if any."""

    index: int
    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int | None = None

    @property
    def window_blocks(self) -> int | None:
        """Blocks before a prefix's end that its next token can attend to; None: all of them."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1) // self.block_size)

    def needed_positions(self, num_blocks: int) -> range:
        """The block positions a prefix of `num_blocks` full blocks needs in this group."""
        window_blocks = self.window_blocks
        if window_blocks is None:
            return range(num_blocks)
        return range(max(0, num_blocks - window_blocks), num_blocks)

    @property
    def name(self) -> str:
        """What tells this group's stored blocks apart from another group's of the same model."""
        kind = "full" if self.sliding_window is None else f"sliding_window={self.sliding_window}"
        return f"group={self.index};{kind};layers={','.join(self.layer_names)}"


def cache_groups(kv_cache_config: KVCacheConfig) -> tuple[CacheGroup, ...]:
    """The groups of `kv_cache_config`, checked to have the same number of layers each.

    Every group's blocks then have the same size, so one stored entry (one
    block of every layer of a group) has one size whatever the group: the
    CPU pool's slots serve all groups.
    """
    groups = tuple(
        CacheGroup(
            index=index,
            layer_names=tuple(group.layer_names),
            block_size=group.kv_cache_spec.block_size,
            sliding_window=(
                group.kv_cache_spec.sliding_window
                if isinstance(group.kv_cache_spec, SlidingWindowSpec)
                else None
            ),
        )
        for index, group in enumerate(kv_cache_config.kv_cache_groups)
    )
    if not groups:
        raise ValueError("kv_cache_config.kv_cache_groups is empty; expected at least one group")
    sizes = sorted({len(group.layer_names) for group in groups})
    if len(sizes) > 1:
        raise ValueError(
            "kv_cache_config.kv_cache_groups: groups have "
            f"{', '.join(str(size) for size in sizes)} layers; every group must have "
            "the same number of layers (as the hybrid KV cache manager builds them)"
        )
    return groups


def layers_per_group(groups: Sequence[CacheGroup]) -> int:
    """The number of layers in each group (the same for all: see `cache_groups`)."""
    return len(groups[0].layer_names)
