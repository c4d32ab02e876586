"""A parallel engine's peer: each rank's share of a block, its agent, and the split's name.

A tensor-parallel rank holds a share of every layer's KV heads, a pipeline
stage some of the layers; block ids, and so the pool slot the scheduler
side gives a block, are the same on every rank. So each rank keeps its
share of a block in its own pool's slot, behind its own NIXL agent and
peer record (`agent_name`), and the scheduler half announces the
block once. A reader's rank `r` pulls the share of the writer's rank
`r`: the same heads and layers, when both engines are split alike.

Engines split differently must never mix shares. The directory names a
block's entry by the fingerprint of the whole split (`split_fingerprints`:
every rank's share, in rank order), so a reader of another layout (TP=1
reading a TP=2 writer, or the reverse) finds no entry at all: a clean
miss, computed. Each rank's entries carry its share in their layout
fingerprint (`rank_layout`), so bytes of another rank's share are
refused even if a pull ever reached them. An unsplit engine's names are
those of an unsplit layout: its entries stay what they were.
"""

from __future__ import annotations

import hashlib

import attrs

from kvwire.blocks.format import BlockLayout, HeadShard, LayerShard
from kvwire.config import ParallelConfig


def is_split(parallel: ParallelConfig) -> bool:
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1


def rank_layout(layout: BlockLayout, parallel: ParallelConfig, rank: int) -> BlockLayout:
    """Rank `rank`'s share of a block, named; `layout` is any rank's (one rank's heads).

    Raises `ValueError` naming `pipeline_layers` for pipeline stages
    whose layers are not given.
    """
    tensor_size = parallel.tensor_parallel_size
    share = attrs.evolve(parallel, rank=rank)
    if tensor_size > 1:
        per_rank = layout.num_kv_heads
        first = share.tensor_rank * per_rank
        layout = attrs.evolve(
            layout, kv_heads=HeadShard(first, first + per_rank, per_rank * tensor_size)
        )
    if parallel.pipeline_parallel_size > 1:
        stage = share.stage_layers(share.pipeline_rank)
        if stage is None:
            raise ValueError(
                "parallel_config.pipeline_layers: the peer medium needs each pipeline stage's "
                "first layer then the model's layer count; got none"
            )
        total = parallel.pipeline_layers[-1]
        layout = attrs.evolve(
            layout,
            num_layers=len(stage),
            layers=LayerShard(stage.start, stage.stop, total),
        )
    return layout


def split_fingerprints(
    group_layouts: tuple[BlockLayout, ...], parallel: ParallelConfig
) -> tuple[str, ...]:
    """Each KV cache group's name in the directory: its layout's, over every rank's share.

    `group_layouts` are any one rank's. Unsplit, the layout's own fingerprint.
    """
    if not is_split(parallel):
        return tuple(layout.fingerprint_hex for layout in group_layouts)
    ranks = range(parallel.tensor_parallel_size * parallel.pipeline_parallel_size)
    names = []
    for layout in group_layouts:
        every = b"".join(rank_layout(layout, parallel, rank).fingerprint for rank in ranks)
        names.append(hashlib.blake2b(every, digest_size=len(layout.fingerprint)).hexdigest())
    return tuple(names)


def agent_name(peer: str, parallel: ParallelConfig, rank: int) -> str:
    """The NIXL agent and peer record of `peer`'s rank `rank`.

    Unsplit, the peer's own name. A rank's name holds a space, which no peer
    name does, so it never equals another peer's.
    """
    return f"{peer} rank{rank}" if is_split(parallel) else peer
