"""Entries that outlive the parallel layout: which groups of KV heads a rank stores and reads.

A tensor-parallel engine splits every layer's KV heads over its ranks: of a
model's `H` heads, tensor rank `r` of `tp` holds `[r * H / tp,
(r + 1) * H / tp)`, and block ids are the same on every rank. A store
medium keeps one entry per block and group of `entry_kv_heads`
consecutive heads (`HeadShard`, named in the
entry's fingerprint), so what is stored depends on that setting only, never
on how the writer was split: engines that share a store and set the same
`entry_kv_heads` read each other's entries whatever their
`tensor_parallel_size`, as long as each rank's heads are whole groups
(`entry_kv_heads` divides `H / tp`; 1 always does). Unset, an entry
holds what one rank holds (all heads at `tp` 1, as entries always did).

Pipeline parallelism splits the layers the same way: stage `s` holds the
layers `parallel.stage_layers(s)`, and an entry holds `entry_layers`
consecutive layers (`LayerShard`, by index in
the whole model, read from the layer's name). Unset, an entry holds a
stage's layers (all of them without pipeline parallelism); engines of
different pipeline sizes share entries when they set `entry_layers` alike
(1 always works).

Each rank writes and reads only its own groups; a lookup (the scheduler
side, which serves every rank) asks for every group of every block, in one
call: a block counts as stored only when all of its groups are, so a save
that landed on one rank and not another is a miss for the whole block.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Generic, TypeVar

import attrs

from kvwire.blocks.format import BlockLayout, HeadShard, LayerShard
from kvwire.config import ParallelConfig

ShardT = TypeVar("ShardT", bound=HeadShard)


@attrs.frozen
class ShardPlan(Generic[ShardT]):
    """The groups of one engine's entries along one split: this rank's, and every rank's.

    Groups of heads (`plan_heads`: a tensor rank's) or of layers (`plan_layers`: a stage's).
    """

    own: tuple[ShardT, ...]
    every: tuple[ShardT, ...]
    first_own: int
    """The model head (layer) this rank (stage) holds first: its local head (layer) 0."""

    @property
    def is_whole(self) -> bool:
        """One entry of all the model's heads (layers) per block: an unsplit engine's format."""
        return len(self.every) == 1

    def local(self, shard: ShardT) -> range:
        """`shard`'s heads as indices into this rank's KV cache (layers: into a stage's list)."""
        return range(shard.start - self.first_own, shard.stop - self.first_own)


def plan_heads(
    local_kv_heads: int, parallel: ParallelConfig, entry_kv_heads: int | None
) -> ShardPlan[HeadShard]:
    """The head groups of a rank holding `local_kv_heads` heads, at `entry_kv_heads` a group.

    `entry_kv_heads` None: a rank's heads per group. Raises `ValueError`
    naming `entry_kv_heads` when a rank's heads are not whole groups.
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
    return ShardPlan(own=own, every=every, first_own=first)


_LAYER_INDEX = re.compile(r"\d+")


def layer_index(name: str) -> int | None:
    """The model layer a KV cache layer's name numbers (`model.layers.3.self_attn.attn`: 3)."""
    numbers = _LAYER_INDEX.findall(name)
    return int(numbers[0]) if len(numbers) == 1 else None


def plan_layers(
    layer_names: Sequence[str], parallel: ParallelConfig, entry_layers: int | None
) -> ShardPlan[LayerShard]:
    """The layer groups of a stage holding `layer_names`, at `entry_layers` layers a group.

    Raises `ValueError` naming `entry_layers` when a stage's layers are
    not whole groups, or when the layers' names do not number them in a row
    from the stage's first.
    """
    stage = parallel.stage_layers(parallel.pipeline_rank)
    if stage is None:
        if entry_layers is None:
            whole = LayerShard(0, len(layer_names), len(layer_names))
            return ShardPlan(own=(whole,), every=(whole,), first_own=0)
        stage = range(len(layer_names))
    indices = [layer_index(name) for name in layer_names]
    if indices != list(stage):
        raise ValueError(
            f"kv_cache_config: the layers' names number them {indices[:8]}, expected the "
            f"stage's layers {stage.start}..{stage.stop - 1} in order (one number in each name); "
            "entries of groups of layers need them"
        )
    total = parallel.pipeline_layers[-1] if parallel.pipeline_layers else len(layer_names)
    if entry_layers is None:
        bounds = parallel.pipeline_layers or (0, total)
        every = tuple(LayerShard(a, b, total) for a, b in itertools.pairwise(bounds))
    else:
        bounds = parallel.pipeline_layers or (0, total)
        if any(bound % entry_layers and bound != total for bound in bounds):
            raise ValueError(
                f"kv_connector_extra_config.entry_layers: {entry_layers} does not divide the "
                f"pipeline stages' first layers {list(bounds[:-1])[:8]} (the model has {total}); "
                "expected a divisor of each (1 always works, and lets engines of any "
                "pipeline_parallel_size share entries)"
            )
        every = tuple(
            LayerShard(start, min(start + entry_layers, total), total)
            for start in range(0, total, entry_layers)
        )
    own = tuple(shard for shard in every if stage.start <= shard.start < stage.stop)
    return ShardPlan(own=own, every=every, first_own=stage.start)


def entry_layout(
    layout: BlockLayout, shard: HeadShard, layers: LayerShard | None = None
) -> BlockLayout:
    """The layout of an entry of `shard`'s heads (and `layers`), from `layout` (a rank's)."""
    layout = attrs.evolve(
        layout, num_kv_heads=shard.count, kv_heads=None if shard.is_whole else shard
    )
    if layers is None:
        return layout
    return attrs.evolve(layout, num_layers=layers.count, layers=None if layers.is_whole else layers)
