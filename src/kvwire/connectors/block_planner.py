"""Scheduler-side planning shared by the connectors that move whole blocks by hash.

The CPU-offload connector and the store connectors decide the same two things
per request, whatever holds the blocks:

- what to load: at lookup, the consecutive prefix of the request's full
  blocks beyond the engine's local ones that the medium holds; at
  allocation, the cache block ids those blocks go to;
- what to save: each step, the full blocks that this step computes and that
  were neither loaded nor saved before. A block whose load failed is
  computed again by the engine, so it is saved again: the medium, which
  dropped the bad entry, gets a good one back in the same run.

:class:`BlockPlanner` keeps that bookkeeping. It never touches the medium: a
connector passes in how to count hits, and turns each planned
:class:`BlockRange` into its own transfer record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from kvwire.connector.types import BlockHash, KVCacheBlocks, Request, SchedulerOutput

HitCounter = Callable[[Sequence[BlockHash]], int]
"""Counts how many of the given block hashes, from the first, the medium holds."""


@attrs.frozen
class BlockRange:
    """Consecutive full blocks of one request: their cache block ids and hashes, in order."""

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    # For a save: the request's blocks up to the last one saved. Their KV was
    # computed attending to all of these; one that failed to load spoils it.
    context_block_ids: tuple[int, ...] = ()


@attrs.define
class _Lookup:
    first_block: int
    hit_blocks: int
    candidate_blocks: int


@attrs.define
class _SaveCursor:
    request: Request
    next_block_to_save: int
    # The request's cache block ids, as last seen (allocation, then each step).
    block_ids: Sequence[int] = ()


class BlockPlanner:
    """Which full blocks of each request to load and to save (scheduler side).

    ``loads``/``saves`` say whether the engine is a KV consumer/producer; a
    planner that does not load finds no hits, one that does not save plans
    no saves. ``lookup_hit_blocks``/``lookup_miss_blocks`` count the blocks
    found and not found by the lookups of the requests allocated since the
    last :meth:`take_lookup_counts`.
    """

    def __init__(self, block_size: int, *, loads: bool, saves: bool) -> None:
        self._block_size = block_size
        self._loads = loads
        self._saves = saves
        self._lookups: dict[str, _Lookup] = {}
        self._save_cursors: dict[str, _SaveCursor] = {}
        self.lookup_hit_blocks = 0
        self.lookup_miss_blocks = 0

    def look_up(self, request: Request, num_computed_tokens: int, count_hits: HitCounter) -> int:
        """Remember and return how many blocks after the local ones the medium holds."""
        first_block = num_computed_tokens // self._block_size
        # At least one prompt token is always left to compute: the engine needs
        # logits for it.
        last_block = min((request.num_tokens - 1) // self._block_size, len(request.block_hashes))
        if not self._loads or last_block <= first_block:
            self._lookups[request.request_id] = _Lookup(first_block, 0, 0)
            return 0
        hits = count_hits(request.block_hashes[first_block:last_block])
        self._lookups[request.request_id] = _Lookup(first_block, hits, last_block - first_block)
        return hits

    def allocate(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> BlockRange | None:
        """Start planning the request's saves; return the blocks it loads, if any.

        Blocks found at lookup are not saved again. Raises ``ValueError`` when
        the engine asks for more external tokens than the lookup found.
        """
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            lookup = _Lookup(request.num_computed_tokens // self._block_size, 0, 0)
        self.lookup_hit_blocks += lookup.hit_blocks
        self.lookup_miss_blocks += lookup.candidate_blocks - lookup.hit_blocks
        all_block_ids = blocks.get_block_ids()[0]
        self._save_cursors[request.request_id] = _SaveCursor(
            request,
            next_block_to_save=lookup.first_block + lookup.hit_blocks,
            block_ids=all_block_ids,
        )
        num_blocks = num_external_tokens // self._block_size
        if num_blocks <= 0:
            return None
        if num_blocks > lookup.hit_blocks:
            raise ValueError(
                f"update_state_after_alloc: request {request.request_id!r} asks for "
                f"{num_external_tokens} external tokens, the lookup found "
                f"{lookup.hit_blocks * self._block_size}"
            )
        start, end = lookup.first_block, lookup.first_block + num_blocks
        return BlockRange(
            request_id=request.request_id,
            block_ids=tuple(all_block_ids[start:end]),
            block_hashes=tuple(request.block_hashes[start:end]),
        )

    def loads_failed(self, block_ids: set[int]) -> None:
        """Plan to save again, once recomputed, the blocks whose loads failed, and those after.

        The engine computes a request again from its first failed block; the
        medium no longer holds a good copy of it (the connector drops a
        corrupt entry), so that block and the following ones are saved anew.
        """
        if not block_ids:
            return
        for cursor in self._save_cursors.values():
            # By the request's block ids, not by what this planner loaded: in a
            # composite, another connector may have made the failed load.
            failed = [i for i, block_id in enumerate(cursor.block_ids) if block_id in block_ids]
            if failed:
                cursor.next_block_to_save = min(cursor.next_block_to_save, failed[0])

    def plan_saves(self, scheduler_output: SchedulerOutput) -> list[BlockRange]:
        """The blocks to save this step, one range per request that has new full blocks."""
        if not self._saves:
            return []
        ranges: list[BlockRange] = []
        for item in scheduler_output.scheduled:
            cursor = self._save_cursors.get(item.request_id)
            if cursor is None:
                continue
            block_ids = item.block_ids[0]
            cursor.block_ids = block_ids
            hashes = cursor.request.block_hashes
            # Only full blocks whose hash is known and whose KV exists after this step.
            tokens_after_step = item.num_computed_tokens + item.num_scheduled_tokens
            end = min(tokens_after_step // self._block_size, len(hashes), len(block_ids))
            start = cursor.next_block_to_save
            if end <= start:
                continue
            cursor.next_block_to_save = end
            ranges.append(
                BlockRange(
                    request_id=item.request_id,
                    block_ids=tuple(block_ids[start:end]),
                    block_hashes=tuple(hashes[start:end]),
                    context_block_ids=tuple(block_ids[:end]),
                )
            )
        return ranges

    def forget(self, request_id: str) -> None:
        """Drop a finished request's lookup and save plan."""
        self._lookups.pop(request_id, None)
        self._save_cursors.pop(request_id, None)

    def take_lookup_counts(self) -> tuple[int, int]:
        """The hit and miss block counts since the last call, then reset them."""
        counts = (self.lookup_hit_blocks, self.lookup_miss_blocks)
        self.lookup_hit_blocks = self.lookup_miss_blocks = 0
        return counts
