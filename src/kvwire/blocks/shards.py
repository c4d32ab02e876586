"""Entries that outlive the parallel layout: which groups of KV heads a rank stores and reads.

A tensor-parallel engine splits every layer's KV heads over its ranks: of a
model's ``H`` heads, tensor rank ``r`` of ``tp`` holds ``[r * H / tp,
(r + 1) * H / tp)``, and block ids are the same on every rank. A store
medium keeps one entry per block and group of ``entry_kv_heads``
consecutive heads (:class:`~kvwire.blocks.format.HeadShard`, named in the
entry's fingerprint), so what is stored depends on that setting only, never
on how the writer was split: engines that share a store and set the same
``entry_kv_heads`` read each other's entries whatever their
``tensor_parallel_size``, as long as each rank's heads are whole groups
(``entry_kv_heads`` divides ``H / tp``; 1 always does). Unset, an entry
holds what one rank holds (all heads at ``tp`` 1, as entries always did).

Each rank writes and reads only its own groups; a lookup (the scheduler
side, which serves every rank) asks for every group of every block, in one
call: a block counts as stored only when all of its groups are, so a save
that landed on one rank and not another is a miss for the whole block.
"""

from __future__ import annotations

import attrs

from kvwire.blocks.format import BlockLayout, HeadShard
from kvwire.config import ParallelConfig


@attrs.frozen
class HeadPlan:
    """The head groups of one engine's entries: this rank's, and every rank's."""

    own: tuple[HeadShard, ...]
    every: tuple[HeadShard, ...]
    first_own_head: int
    """The model head this rank's KV cache holds first (its local head 0)."""

    @property
    def is_whole(self) -> bool:
        """One entry of all the model's heads per block: the format of an unsplit engine."""
        return len(self.every) == 1

    def local_heads(self, shard: HeadShard) -> range:
        """``shard``'s heads as indices into this rank's KV cache."""
        return range(shard.start - self.first_own_head, shard.stop - self.first_own_head)


def plan_heads(
    local_kv_heads: int, parallel: ParallelConfig, entry_kv_heads: int | None
) -> HeadPlan:
    """The head groups of a rank holding ``local_kv_heads`` heads, at ``entry_kv_heads`` a group.

    ``entry_kv_heads`` None: a rank's heads per group. Raises ``ValueError``
    naming ``entry_kv_heads`` when a rank's heads are not whole groups.
    """
    tensor_size = parallel.tensor_parallel_size
    total = local_kv_heads * tensor_size
    per_entry = local_kv_heads if entry_kv_heads is None else entry_kv_heads
    if local_kv_heads % per_entry:
        raise ValueError(
            f"kv_connector_extra_config.entry_kv_heads: {per_entry} does not divide the "
            f"{local_kv_heads} KV heads each of the {tensor_size} tensor-parallel ranks holds "
            f"(the model has {total}); expected a divisor of {local_kv_heads} (1 always works, "
            "and lets engines of any tensor_parallel_size share entries)"
        )
    first = parallel.tensor_rank * local_kv_heads
    every = tuple(
        HeadShard(start, start + per_entry, total) for start in range(0, total, per_entry)
    )
    own = tuple(shard for shard in every if first <= shard.start < first + local_kv_heads)
    return HeadPlan(own=own, every=every, first_own_head=first)


def entry_layout(layout: BlockLayout, shard: HeadShard) -> BlockLayout:
    """The layout of an entry of ``shard``'s heads, from ``layout`` (one of a rank's blocks)."""
    if shard.is_whole:
        return attrs.evolve(layout, num_kv_heads=shard.count, kv_heads=None)
    return attrs.evolve(layout, num_kv_heads=shard.count, kv_heads=shard)
