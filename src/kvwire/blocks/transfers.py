"""The one record of blocks to move, from the scheduler half's plan to the worker that moves them.

`BlockPlanner` makes them, the
connectors send them in their step metadata (pickled across the worker
process), and `StoreTransferHandler` and
`CPUPoolTransferHandler` move their blocks. What a medium's scheduler half
tells its worker half about a transfer travels with it as one
`kvwire.media.TransferPayload` of the medium's own, which
no connector reads.
"""

from __future__ import annotations

import attrs

from kvwire.interface.types import BlockHash

__all__ = ["BlockTransfer", "TransferPayload"]


class TransferPayload:
    """A medium's own record of a transfer, from its scheduler half to its worker half.

    The connector carries it untouched: from `MediumIndex.prepare_load` with
    the load it prepared, or from `MediumIndex.take_step_payload` with the
    step's plan. A subclass is a picklable record (an `attrs.frozen` class
    defined at module level): it crosses to the worker process in the step's
    metadata. One that keeps a record per block overrides `part`, so that a
    piece of a transfer carries the records of its own blocks.
    """

    def part(self, start: int, stop: int) -> TransferPayload:
        """The payload of the transfer's blocks `start:stop`; by default the whole one."""
        return self


@attrs.frozen(kw_only=True)
class BlockTransfer:
    """Blocks of one request in one KV cache group to load or save, in block order.

    `block_ids`, `block_hashes` and, when given, `slots` are parallel:
    the i-th of each describes the same block.
    """

    request_id: str
    """The request the blocks belong to: finished, failed and kept blocks are reported by it."""
    block_ids: tuple[int, ...]
    """The blocks' ids in the paged KV cache of `kvwire.media.BlockTransfer.group` (never
    the null block)."""
    block_hashes: tuple[BlockHash, ...]
    """The blocks' hashes: what names each block's entry in the medium."""
    slots: tuple[int, ...] = ()
    """The CPU pool's entry slots the blocks are copied to or from; empty for store media."""
    payload: TransferPayload | None = None
    """For a load: what the medium's index gave with it (`LoadSpec.payload`), for its handler
    alone; None when it gave nothing."""
    context_block_ids: tuple[int, ...] = ()
    """For a save: the request's blocks, in every group, up to the last one saved; empty for a load.

    The saved blocks' KV was computed attending to all of these, so one that
    failed to load spoils the save.
    """
    group: int = 0
    """The KV cache group whose layers the blocks are read from or written to."""
