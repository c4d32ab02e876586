"""What the offload connector's two halves tell each other each step (both picklable)."""

from __future__ import annotations

import attrs

from kvwire.blocks.transfers import BlockTransfer, TransferPayload
from kvwire.interface.base import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = ["OffloadMetadata", "OffloadWorkerMetadata"]


@attrs.frozen
class OffloadMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler half to the worker half.

    `release_req_ids`: finished requests that kept their blocks (a save or
    an asynchronous load may still use them); the worker reports each
    finished sending once none does. `preempted_req_ids`: requests whose
    blocks the engine took back; their saves end before the forward pass.
    `new_block_ids`: block ids given to requests since the last step, to be
    written from this step on; saves still reading one are released.
    `counters`: the scheduler half's counts (lookups, the medium index's
    own), reported with the worker's stats. `idle`: the step computes no
    token (what it holds waits for asynchronous loads); the worker then waits
    for those loads a little in `get_finished` instead of handing the engine
    back at once to a loop that would step again and again, holding the GIL
    the load threads need. `medium_payload`: the medium's own work for the
    step (`MediumIndex.take_step_payload`), started before the loads.
    """

    loads: tuple[BlockTransfer, ...] = ()
    async_loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()
    release_req_ids: tuple[str, ...] = ()
    preempted_req_ids: tuple[str, ...] = ()
    new_block_ids: frozenset[int] = frozenset()
    counters: tuple[tuple[str, int], ...] = ()
    idle: bool = False
    medium_payload: TransferPayload | None = None


@attrs.frozen
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's report from the worker half: the planned saves it did not make.

    `released_saves`: stopped because a block they read was given to
    another request. `left_out_saves`: never started, because they were
    computed from a block whose load failed. Either way the scheduler half
    tells the medium's index the save did not succeed, so it is never published.
    """

    released_saves: tuple[BlockTransfer, ...] = ()
    left_out_saves: tuple[BlockTransfer, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadWorkerMetadata:
        # Split engines' workers each report what they released or left out.
        theirs = of_worker_metadata(other)
        return OffloadWorkerMetadata(
            self.released_saves + theirs.released_saves,
            self.left_out_saves + theirs.left_out_saves,
        )


def of_worker_metadata(worker_meta: object) -> OffloadWorkerMetadata:
    """`worker_meta`, or a `TypeError` when another connector's worker made it."""
    if not isinstance(worker_meta, OffloadWorkerMetadata):
        raise TypeError(
            f"got worker metadata of type {type(worker_meta).__name__}, "
            "expected OffloadWorkerMetadata"
        )
    return worker_meta
