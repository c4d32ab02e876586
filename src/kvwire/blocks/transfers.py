"""The one record of blocks to move, from the scheduler half's plan to the worker that moves them.

`BlockPlanner` makes them, the
connectors send them in their step metadata (pickled across the worker
process), and `StoreTransferHandler` and
`CPUPoolTransferHandler` move their blocks.
"""

from __future__ import annotations

import attrs

from kvwire.interface.types import BlockHash

__all__ = ["BlockTransfer"]


@attrs.frozen(kw_only=True)
class BlockTransfer:
    """Blocks of one request in one KV cache group to load or save, in block order.

    `block_ids`, `block_hashes` and, when given, `slots` are parallel:
    the i-th of each describes the same block.
    """

    request_id: str
    """The request the blocks belong to: finished, failed and kept blocks are reported by it."""
    block_ids: tuple[int, ...]
    """The blocks' ids in the paged KV cache of [`group`][kvwire.media.BlockTransfer.group] (never
    the null block)."""
    block_hashes: tuple[BlockHash, ...]
    """The blocks' hashes: what names each block's entry in the medium."""
    slots: tuple[int, ...] = ()
    """The CPU pool's entry slots the blocks are copied to or from; empty for store media."""
    sources: tuple[str, ...] = ()
    """For a load: where the scheduler half's lookup found each block, in the medium's own
    words (the peer medium's directory entries); empty when the worker finds them itself.

    A hint, not a promise: the block may have moved since, so the worker
    still verifies what it reads there. For a save: where else in the medium
    each block goes (`MediumIndex.save_sources`); empty for nowhere else.
    """
    context_block_ids: tuple[int, ...] = ()
    """For a save: the request's blocks, in every group, up to the last one saved; empty for a load.

    The saved blocks' KV was computed attending to all of these, so one that
    failed to load spoils the save.
    """
    group: int = 0
    """The KV cache group whose layers the blocks are read from or written to."""
