"""The offload connector's worker half: drives the transfer handler around the forward pass.

The handler only runs transfer jobs; which request and which step each job
serves is kept here, in a `TransferBook`.

Loads write every layer of a block at once, so the first layer waits for
them; saves read every layer after the forward pass, so `save_kv_layer`
does nothing and `wait_for_save` only submits. Before anything of a step
writes the cache, the saves still reading blocks given out again (or blocks
of preempted requests) are released; a save computed from a block whose
load failed is left out. Both are reported to the scheduler half
(`OffloadWorkerMetadata`), which
never publishes them.

Whatever the medium, a block whose load failed is zeroed before the engine
hears of the failure (`kvwire.blocks.scrub`): no byte a failed load wrote
is ever read, by the request that computes it again or by the next one
given that block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvwire.blocks.transfers import BlockTransfer
from kvwire.common.plugin_calls import call_plugin
from kvwire.connectors.offload.metadata import OffloadMetadata, OffloadWorkerMetadata
from kvwire.connectors.offload.transfer_book import TransferBook
from kvwire.connectors.offload.worker_steps import (
    PendingRelease,
    metadata_of_type,
    registered_worker,
    saves_from_good_context,
)
from kvwire.interface.base import KVConnectorMetadata
from kvwire.interface.counters import Counters
from kvwire.interface.types import KVCacheEvent, KVConnectorStats
from kvwire.media.base import Medium, TransferHandler

if TYPE_CHECKING:
    import torch

__all__ = ["OffloadWorkerHalf"]

# How long get_finished waits for asynchronous loads in a step that computes
# nothing. The engine has nothing else to do meanwhile; it bounds how late a
# request that arrives then is scheduled.
IDLE_STEP_WAIT_S = 0.005


class OffloadWorkerHalf:
    """The worker half of one offload connector: its state; its handler is built with the caches.

    `reports_lookups`: whether this worker's stats carry the scheduler
    side's lookup counts (sent in each step's metadata to every rank): only
    rank 0's do, so an engine that sums its ranks' stats counts each lookup
    once.
    """

    def __init__(
        self, *, connector_name: str, medium: Medium, reports_lookups: bool = True
    ) -> None:
        self._connector_name = connector_name
        self._reports_lookups = reports_lookups
        self._medium = medium
        self._counters = Counters()
        self._transfers: TransferBook | None = None
        self._pending_release = PendingRelease()
        self._failed_elsewhere: set[int] = set()
        self._released_for: KVConnectorMetadata | None = None
        self._step_is_idle = False
        self._released_saves: list[BlockTransfer] = []
        self._left_out_saves: list[BlockTransfer] = []

    @property
    def handler(self) -> TransferHandler | None:
        """The medium's transfer handler, once the caches are registered."""
        return self._transfers.handler if self._transfers is not None else None

    @property
    def transfers(self) -> TransferBook | None:
        """The jobs given to the handler, per step and request, once the caches are registered."""
        return self._transfers

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if self._transfers is not None:
            # A second handler would leave the first one's threads and store open.
            raise RuntimeError(
                f"{self._connector_name}: register_kv_caches() was called twice; the caches "
                "are registered once per connector, before the first step"
            )
        # Imported here: it needs torch, which the scheduler half never imports.
        from kvwire.blocks.scrub import BlockScrubber

        handler = call_plugin(
            "kv_connector_extra_config.medium",
            f"{type(self._medium).__name__}.build_handler",
            lambda: self._medium.build_handler(kv_caches, self._counters),
        )
        context = self._medium.context
        scrubber = BlockScrubber(kv_caches, context.groups, context.layout.cache_layout)
        self._transfers = TransferBook(handler, scrubber.scrub)

    def _require_transfers(self) -> TransferBook:
        return registered_worker(self._connector_name, self._transfers)

    def metadata(self, metadata: KVConnectorMetadata) -> OffloadMetadata:
        return metadata_of_type(self._connector_name, metadata, OffloadMetadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Release the saves reading blocks this step may write; once per step.

        vLLM and kvwire's engine call it before the forward pass; an engine
        that does not gets it from `start_load_kv`.
        """
        metadata = self.metadata(kv_connector_metadata)
        self._released_for = kv_connector_metadata
        self._released_saves += self._require_transfers().release_saves_reading(
            metadata.preempted_req_ids, metadata.new_block_ids
        )

    def start_load_kv(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        metadata = self.metadata(kv_connector_metadata)
        transfers = self._require_transfers()
        if self._reports_lookups:
            self._counters.add_many(dict(metadata.counters))
        self._pending_release.add(metadata.release_req_ids)
        self._step_is_idle = metadata.idle
        if kv_connector_metadata is not self._released_for:
            self.handle_preemptions(kv_connector_metadata)
        if metadata.medium_payload is not None:
            # Before the loads: a load may bring a block into a slot this work reads.
            transfers.handler.begin_step(metadata.medium_payload)
        if metadata.loads or metadata.async_loads:
            transfers.start_loads(metadata.loads, metadata.async_loads)

    def wait_for_layer_load(self) -> None:
        # Synchronous loads write every layer at once; the first layer waits.
        if self._transfers is not None:
            self._transfers.wait_for_loads()

    def wait_for_save(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        metadata = self.metadata(kv_connector_metadata)
        transfers = self._require_transfers()
        saves, left_out = self._saves_from_good_context(metadata.saves)
        # Reported, so that the scheduler half never publishes them: the
        # blocks, computed again, are saved anew.
        self._left_out_saves += left_out
        if saves:
            # Only submits: the saves read the blocks in place, in the background.
            transfers.save(saves)

    def _saves_from_good_context(
        self, saves: Sequence[BlockTransfer]
    ) -> tuple[list[BlockTransfer], list[BlockTransfer]]:
        """This step's saves to make, and those computed from a failed load (counted)."""
        failed = self.load_errors_this_step() | self._failed_elsewhere
        self._failed_elsewhere = set()
        kept, left_out = saves_from_good_context(saves, failed)
        if left_out:
            skipped = sum(len(save.block_ids) for save in left_out)
            self._counters.add("saves_skipped_after_failed_load", skipped)
        return kept, left_out

    def load_errors_this_step(self) -> set[int]:
        """Block ids whose synchronous loads failed this step; waits for the loads to end."""
        transfers = self._require_transfers()
        transfers.wait_for_loads()
        return transfers.load_errors_so_far()

    def skip_saves_computed_from(self, block_ids: set[int]) -> None:
        self._failed_elsewhere |= block_ids

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        transfers = self._transfers
        if transfers is None:
            return None, None
        if self._step_is_idle:
            # Returning at once, the engine would step again and again with
            # nothing to compute, holding the GIL between steps: each call of
            # a load thread that releases the GIL (a read, a checksum, a copy)
            # then waits a switch interval to take it back, and a 16 MiB pull
            # took 1.1 s between two vLLM engines instead of 0.08 s.
            self._step_is_idle = False
            transfers.wait_for_async_loads(IDLE_STEP_WAIT_S)
        received = transfers.take_finished_loads()
        sent = self._pending_release.take_released(transfers.is_busy)
        return (sent or None), (received or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._transfers.take_load_errors() if self._transfers is not None else set()

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        released, self._released_saves = self._released_saves, []
        left_out, self._left_out_saves = self._left_out_saves, []
        if not (released or left_out):
            return None
        return OffloadWorkerMetadata(tuple(released), tuple(left_out))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._transfers is not None:
            self._counters.add_many(self._transfers.take_counters())
        return self._counters.take_stats()

    def take_events(self) -> list[KVCacheEvent]:
        return self._transfers.take_events() if self._transfers is not None else []

    def wait_for_pending_saves(self, timeout_s: float | None = None) -> bool:
        return self._transfers.wait_for_saves(timeout_s) if self._transfers is not None else True

    def close(self) -> None:
        if self._transfers is not None:
            self._transfers.close()
