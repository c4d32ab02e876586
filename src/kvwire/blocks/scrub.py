"""Zeroing the KV cache blocks of failed loads, so that no byte a load left there is ever read.

A load that fails (a corrupt or forged entry, a store that raised, a
deadline) may already have written into its cache blocks: a store medium
reads an entry straight into the cache and verifies it there. The engine
computes those blocks again, but a block's last, partly filled part keeps
what was there before: vLLM frees a failed request's blocks without
clearing them, and the next request given such a block as its partly
filled last block attends to its unwritten slots with weight 0, where
0 x NaN is NaN. So every block a load reports failed is zeroed, whole
(every layer of its KV cache group, keys and values, every head), before
the failure reaches the engine: zero KV is finite whatever reads it.

Only failed blocks are touched, so a load that succeeds pays nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from kvwire.blocks.groups import CacheGroup
from kvwire.blocks.memory import BLOCK_DIMENSIONS

__all__ = ["BlockScrubber"]


class BlockScrubber:
    """Zeroes whole blocks of the registered KV caches, by KV cache group.

    `groups` says which layers each group's block ids index (this rank's
    layers of it: a pipeline stage holds some layers only). A registered
    layer that no group names is zeroed for every group's blocks: never
    scrubbing too little matters more than the few bytes more.
    `cache_layout` is the caches' layout (`BlockLayout.cache_layout`),
    which tells the block dimension.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        groups: Sequence[CacheGroup],
        cache_layout: str,
    ) -> None:
        try:
            self._block_dim = BLOCK_DIMENSIONS[cache_layout]
        except KeyError:
            raise ValueError(
                f"BlockScrubber: cache layout {cache_layout!r} is not one of "
                f"{sorted(BLOCK_DIMENSIONS)}"
            ) from None
        grouped = {name for group in groups for name in group.layer_names}
        ungrouped = tuple(tensor for name, tensor in kv_caches.items() if name not in grouped)
        self._layers_of_group = tuple(
            tuple(kv_caches[name] for name in group.layer_names if name in kv_caches) + ungrouped
            for group in groups
        )
        self._every_layer = tuple(kv_caches.values())

    def scrub(self, group: int, block_ids: Iterable[int]) -> int:
        """Zero these blocks in every layer of `group`; how many blocks were zeroed.

        An id outside the cache is skipped (a load never wrote there). A
        group this scrubber does not know zeroes the blocks in every layer.
        """
        layers = (
            self._layers_of_group[group]
            if 0 <= group < len(self._layers_of_group)
            else self._every_layer
        )
        zeroed = 0
        for block_id in block_ids:
            touched = False
            for tensor in layers:
                if 0 <= block_id < tensor.shape[self._block_dim]:
                    tensor.select(self._block_dim, block_id).zero_()
                    touched = True
            zeroed += touched
        return zeroed
