"""What the ranks of a parallel engine report, merged into one engine's report.

Each rank's worker connector reports its own step (`KVConnectorOutput`);
the scheduler side sees one. `RankOutputs` merges them the way vLLM's
`KVOutputAggregator` does: a request finished sending or receiving once
every rank reported it (the scheduler connector's `get_finished_count()`,
else the world size), failed block ids united (a load failed on one rank
fails that block on every rank: it is computed again everywhere), stats
and worker metadata merged with their `aggregate`. KV cache events pass
through `EveryRank`, which vLLM's adapter uses too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import attrs

from kvwire.interface.types import (
    BlockHash,
    BlockStored,
    KVCacheEvent,
    KVConnectorOutput,
    KVConnectorStats,
)

# Blocks some ranks reported stored and others not yet: bounded, the oldest
# forgotten first (a block a rank never stores is never an event).
_PARTLY_STORED_LIMIT = 65536


class EveryRank:
    """Worker events of an engine of `world_size` ranks: each block stored, and removed, once.

    Each rank stores its share of a block (its heads, its layers) and reports
    it; the block is in the store, for a lookup, only when every share is.
    A removal passes at the first rank's report (one share gone is the block
    gone) and resets the block's count; the other ranks' removals of the
    block that follow are the same removal, dropped, until the block is
    stored again.
    """

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._reported: OrderedDict[tuple[str, int | None, BlockHash], int] = OrderedDict()
        # Blocks removed, and how many ranks' reports of that removal may still come.
        self._removed: OrderedDict[tuple[str, int | None, BlockHash], int] = OrderedDict()

    def whole(self, events: Iterable[KVCacheEvent]) -> list[KVCacheEvent]:
        if self._world_size == 1:
            return list(events)
        kept: list[KVCacheEvent] = []
        for event in events:
            if isinstance(event, BlockStored):
                stored = tuple(h for h in event.block_hashes if self._all_reported(event, h))
                if stored:
                    kept.append(BlockStored(stored, event.medium, event.group))
            else:
                removed = tuple(h for h in event.block_hashes if self._first_removal(event, h))
                if removed:
                    kept.append(attrs.evolve(event, block_hashes=removed))
        for pending in (self._reported, self._removed):
            while len(pending) > _PARTLY_STORED_LIMIT:
                pending.popitem(last=False)
        return kept

    def _all_reported(self, event: BlockStored, block_hash: BlockHash) -> bool:
        key = (event.medium, event.group, block_hash)
        count = self._reported.pop(key, 0) + 1
        if count < self._world_size:
            self._reported[key] = count
            return False
        self._removed.pop(key, None)
        return True

    def _first_removal(self, event: KVCacheEvent, block_hash: BlockHash) -> bool:
        key = (event.medium, event.group, block_hash)
        left = self._removed.pop(key, None)
        if left is None:
            self._reported.pop(key, None)
            self._removed[key] = self._world_size - 1
            return True
        if left > 1:
            self._removed[key] = left - 1
        return False


class RankOutputs:
    """Merges each step's per-rank reports into the one the scheduler side gets.

    `finished_count` ranks must report a request finished sending (or
    receiving) before it counts; a rank may report it steps after another.
    """

    def __init__(self, world_size: int, finished_count: int | None = None) -> None:
        self._finished_count = finished_count or world_size
        self._sending_left: dict[str, int] = {}
        self._receiving_left: dict[str, int] = {}
        self._every_rank = EveryRank(world_size)

    def merge(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's report from every rank's (None: a rank without a connector)."""
        reports = [output for output in outputs if output is not None]
        if not reports:
            return None
        sending: set[str] = set()
        receiving: set[str] = set()
        invalid: set[int] = set()
        events: list[KVCacheEvent] = []
        stats: KVConnectorStats | None = None
        worker_meta = None
        for report in reports:
            sending |= self._count(report.finished_sending, self._sending_left)
            receiving |= self._count(report.finished_recving, self._receiving_left)
            invalid |= report.invalid_block_ids
            events.extend(report.kv_cache_events)
            if report.kv_connector_stats is not None:
                stats = (
                    report.kv_connector_stats
                    if stats is None
                    else stats.aggregate(report.kv_connector_stats)
                )
            if report.kv_connector_worker_meta is not None:
                worker_meta = (
                    report.kv_connector_worker_meta
                    if worker_meta is None
                    else worker_meta.aggregate(report.kv_connector_worker_meta)
                )
        return KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=receiving or None,
            kv_connector_stats=stats,
            invalid_block_ids=invalid,
            kv_cache_events=self._every_rank.whole(events),
            kv_connector_worker_meta=worker_meta,
        )

    def _count(self, request_ids: set[str] | None, left: dict[str, int]) -> set[str]:
        done = set()
        for request_id in request_ids or ():
            remaining = left.get(request_id, self._finished_count) - 1
            if remaining:
                left[request_id] = remaining
            else:
                left.pop(request_id, None)
                done.add(request_id)
        return done
