"""A rank's store worker, as the connector sees it, when each block is several entries.

A rank that stores entries of groups of KV heads (see
`kvwire.blocks.shards`) moves `per_group` entries per block of each
KV cache group, one per head group it holds. Its
`StoreTransferHandler` serves them as groups of
their own, `(cache group, head group)` pairs numbered `cache_group *
per_group + head_group`; `HeadGroupsHandler` turns the connector's
transfers (one per cache group) into theirs and its reports back:

- jobs, block ids and failed loads are the same whatever the entry, so
  they pass as they are (a block any of whose entries failed is a load
  error: the engine computes it again);
- a save stopped in any of its entries is reported once, in its cache group;
- a block counts as stored (`BlockStored`) once every entry of it on this
  rank is, and as removed at the first of its entries removed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence, Set

import attrs

from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.types import BlockHash, BlockStored, KVCacheEvent
from kvwire.media.base import JobResult, TransferHandler, TransferJob

# Blocks some but not all of whose entries were reported stored: bounded, the
# oldest forgotten first (a block whose other entries never come is not an event).
_PARTLY_STORED_LIMIT = 65536


class HeadGroupsHandler(TransferHandler):
    """`inner`'s transfers per cache group, `per_group` entries per block."""

    def __init__(self, inner: TransferHandler, per_group: int) -> None:
        self._inner = inner
        self._per_group = per_group
        self._partly_stored: OrderedDict[tuple[str, int, BlockHash], int] = OrderedDict()

    def _expand(self, transfers: Sequence[BlockTransfer]) -> tuple[BlockTransfer, ...]:
        return tuple(
            attrs.evolve(transfer, group=transfer.group * self._per_group + head_group)
            for transfer in transfers
            for head_group in range(self._per_group)
        )

    def submit(self, job: TransferJob) -> None:
        self._inner.submit(attrs.evolve(job, transfers=self._expand(job.transfers)))

    def poll(self) -> list[JobResult]:
        return self._inner.poll()

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        return self._inner.wait(job_ids, until)

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        released: dict[BlockTransfer, None] = {}
        for piece in self._inner.release_saves_reading(request_ids, block_ids):
            released[attrs.evolve(piece, group=piece.group // self._per_group)] = None
        return list(released)

    def take_events(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        for event in self._inner.take_events():
            if isinstance(event, BlockStored):
                stored = self._wholly_stored(event)
                if stored:
                    group = None if event.group is None else event.group // self._per_group
                    events.append(BlockStored(stored, event.medium, group))
            else:  # removals name their cache group already (the worker's group_of)
                events.append(event)
        return events

    def _wholly_stored(self, event: BlockStored) -> tuple[BlockHash, ...]:
        """The blocks of `event` whose every entry on this rank is now stored."""
        if self._per_group == 1:
            return tuple(event.block_hashes)
        group = -1 if event.group is None else event.group // self._per_group
        whole = []
        for block_hash in event.block_hashes:
            key = (event.medium, group, block_hash)
            count = self._partly_stored.pop(key, 0) + 1
            if count == self._per_group:
                whole.append(block_hash)
            else:
                self._partly_stored[key] = count
        while len(self._partly_stored) > _PARTLY_STORED_LIMIT:
            self._partly_stored.popitem(last=False)
        return tuple(whole)

    def take_counters(self) -> Mapping[str, float]:
        return self._inner.take_counters()

    def close(self) -> None:
        self._inner.close()
