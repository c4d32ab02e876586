"""Scheduler-side planning shared by the connectors that move whole blocks by hash.

The CPU-offload connector and the store connectors decide the same two things
per request, whatever holds the blocks:

- what to load: at lookup, the longest prefix of the request's full blocks
  beyond the engine's local ones that the medium holds in every KV cache
  group (all its blocks in a full-attention group, the last ones its window
  reaches in a sliding-window group, see `kvwire.blocks.groups`);
  at allocation, the cache block ids those blocks go to, per group;
- what to save: each step, the full blocks that this step computes and that
  were neither loaded nor saved before. A sliding-window group saves only
  windows, at the points where a later request's hit can end: the end of
  each step's computed prefix (and the block before it when that end is
  block-aligned: a later prompt equal to the prefix recomputes its last
  token, so its hit ends a block earlier), and the end of the request's local
  prefix hit, or of its full-attention groups' hit in the medium when no
  saved window reaches that far: where it branched from an earlier request
  (a later request branching there finds its window too), unless the medium
  holds that window already. A block whose load failed is computed again by the
  engine, so it is saved again: the medium, which dropped the bad entry,
  gets a good one back in the same run.

`BlockPlanner` keeps that bookkeeping. It never touches the medium: a
connector passes in how to count hits, and sends the planned
`kvwire.media.BlockTransfer` records to its worker half
(the CPU pool adds the slots).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from kvwire.blocks.groups import NULL_BLOCK_ID, CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.types import BlockHash, KVCacheBlocks, Request, SchedulerOutput

MAX_FAILED_LOAD_REQUESTS = 65536
"""The most requests whose failed load a planner remembers (one position each) at once."""

HitCounter = Callable[[int, Sequence[BlockHash]], int]
"""Counts how many of the given block hashes, from the first, the medium holds for a group.

Called with the group's index and the hashes; a sliding-window group's window
is asked for last block first, so the answer says where the nearest gap is.
"""


@attrs.frozen
class LookupSpan:
    """A request's block hashes, and the positions a lookup asks about: `first_block` on.

    Positions from `last_block` on are never offered (the last prompt
    token's block, a failed load's blocks, those past the request's
    `max_load_tokens`); `capped_blocks` of them only for its
    `max_load_tokens`. A snapshot: a lookup thread reads it while the
    engine extends the request.
    """

    block_hashes: tuple[BlockHash, ...]
    first_block: int
    last_block: int
    capped_blocks: int = 0


@attrs.define
class _Lookup:
    first_block: int
    hit_blocks: int
    candidate_blocks: int
    # Blocks a `max_load_tokens` kept out of the lookup (see LookupSpan).
    capped_blocks: int = 0
    # Per sliding-window group: the positions of windows to save where the
    # request branches from saved ones (see BlockPlanner.look_up).
    branch_windows: dict[int, list[int]] = attrs.field(factory=dict)


@attrs.define
class _SaveCursor:
    request: Request
    # Per group: the first block position not yet saved (or loaded).
    next_block_to_save: list[int]
    # Per group: the request's cache block ids, as last seen (allocation, then each step).
    block_ids: tuple[list[int], ...] = ()
    # Per sliding-window group: branch-window positions not saved yet (those
    # the request has not computed yet wait for the step that computes them).
    branch_windows: dict[int, list[int]] = attrs.field(factory=dict)
    # Blocks before this position were the engine's own at allocation (its local hit).
    local_blocks: int = 0


class BlockPlanner:
    """Which full blocks of each request to load and to save, per KV cache group (scheduler half).

    `loads`/`saves` say whether the engine is a KV consumer/producer; a
    planner that does not load finds no hits, one that does not save plans
    no saves. `lookup_hit_blocks`/`lookup_miss_blocks` count the blocks
    found and not found by the lookups of the requests allocated since the
    last `take_lookup_counts`, `load_blocks_capped` those a request's
    `max_load_tokens` kept out of them. `window_aware=False` saves every
    block of a sliding-window group too, as a connector unaware of windows
    would (what `python -m benchmarks --only hybrid` compares against).
    """

    def __init__(
        self,
        block_size: int,
        groups: Sequence[CacheGroup],
        *,
        loads: bool,
        saves: bool,
        window_aware: bool = True,
        max_failed_load_requests: int = MAX_FAILED_LOAD_REQUESTS,
    ) -> None:
        self._block_size = block_size
        self._groups = tuple(groups)
        self._full_groups = tuple(g for g in self._groups if g.window_blocks is None)
        self._sliding_groups = tuple(g for g in self._groups if g.window_blocks is not None)
        # With a sliding-window group (alone or beside others) block id 0 is the
        # engine's null block, held at the positions that left the window.
        self._null_block: int | None = (
            NULL_BLOCK_ID if len(self._groups) > 1 or self._sliding_groups else None
        )
        self._loads = loads
        self._saves = saves
        self._window_aware = window_aware
        self._lookups: dict[str, _Lookup] = {}
        self._save_cursors: dict[str, _SaveCursor] = {}
        # Per request whose load from this medium failed: the first failed
        # block's position. Nothing from there on is offered to it again.
        self._failed_load_starts: dict[str, int] = {}
        self._max_failed_load_requests = max_failed_load_requests
        self._new_block_ids: set[int] = set()
        self.lookup_hit_blocks = 0
        self.lookup_miss_blocks = 0
        self.load_blocks_capped = 0

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    def look_up(
        self,
        request: Request,
        num_computed_tokens: int,
        count_hits: HitCounter,
        max_load_tokens: int | None = None,
    ) -> int:
        """Remember and return how many blocks after the local ones the medium holds.

        `max_load_tokens` caps them (see `lookup_span`).
        """
        span = self.lookup_span(request, num_computed_tokens, max_load_tokens)
        lookup = self.probe(span, count_hits)
        self._lookups[request.request_id] = lookup
        return lookup.hit_blocks

    def lookup_span(
        self, request: Request, num_computed_tokens: int, max_load_tokens: int | None = None
    ) -> LookupSpan:
        """What a lookup of `request` asks about, fixed now: its hashes and the blocks looked up.

        With `max_load_tokens`, no block ending past `num_computed_tokens +
        max_load_tokens` is looked up: the request loads at most that many
        tokens, in whole blocks, and computes the rest.
        """
        first_block = num_computed_tokens // self._block_size
        # At least one prompt token is always left to compute: the engine needs
        # logits for it.
        last_block = min((request.num_tokens - 1) // self._block_size, len(request.block_hashes))
        # A load that failed would fail again (a load slower than its deadline)
        # and have the engine recompute, then ask again, without end.
        last_block = min(last_block, self._failed_load_starts.get(request.request_id, last_block))
        capped_blocks = 0
        if max_load_tokens is not None:
            cap_end = max(first_block, (num_computed_tokens + max_load_tokens) // self._block_size)
            capped_blocks = max(0, last_block - cap_end)
            last_block -= capped_blocks
        return LookupSpan(tuple(request.block_hashes), first_block, last_block, capped_blocks)

    def probe(self, span: LookupSpan, count_hits: HitCounter) -> _Lookup:
        """The questions a lookup of `span` asks `count_hits`, and what they found.

        Reads only the planner's settings, never its per-request state, so a
        lookup thread may run it while the scheduler's thread uses the planner.
        """
        hashes, first_block, last_block = span.block_hashes, span.first_block, span.last_block
        branches = self._missing_local_branch_windows(hashes, first_block, count_hits)
        if not self._loads or last_block <= first_block:
            return _Lookup(first_block, 0, 0, span.capped_blocks, branches)
        full_end = last_block
        for group in self._full_groups:
            if full_end > first_block:
                full_end = first_block + count_hits(group.index, hashes[first_block:full_end])
        end = self._sliding_prefix_end(hashes, first_block, full_end, count_hits)
        if end < full_end and self._window_aware and self._saves:
            # The full groups match further than any saved window reaches: the
            # request branches there from a saved one. It computes that window
            # (all of it from `end` on), so it can save it for the next one.
            for group in self._sliding_groups:
                window = group.needed_positions(full_end)
                branches.setdefault(group.index, []).extend(range(max(end, window.start), full_end))
        return _Lookup(
            first_block, end - first_block, last_block - first_block, span.capped_blocks, branches
        )

    def _missing_local_branch_windows(
        self, hashes: Sequence[BlockHash], first_block: int, count_hits: HitCounter
    ) -> dict[int, list[int]]:
        """Per sliding group, the window ending at the local hit, if the medium lacks it.

        The engine holds it (a sliding-window group keeps the window of its
        computed prefix), so it can be saved; one question per group.
        """
        if not (self._window_aware and self._saves and first_block):
            return {}
        missing = {}
        for group in self._sliding_groups:
            window = group.needed_positions(first_block)
            held = count_hits(group.index, [hashes[p] for p in reversed(window)])
            if held < len(window):
                missing[group.index] = list(window)
        return missing

    def _sliding_prefix_end(
        self, hashes: Sequence[BlockHash], first_block: int, end: int, count_hits: HitCounter
    ) -> int:
        """The largest prefix end, at most `end`, whose window every sliding group holds.

        Blocks before `first_block` are the engine's own. A window with a
        gap rules out every end whose window covers the gap, so the next
        candidate ends just before it: one question per gap, not per end.
        """
        while end > first_block:
            for group in self._sliding_groups:
                window = hashes[max(first_block, end - (group.window_blocks or 0)) : end]
                held_from_last = count_hits(group.index, window[::-1])
                if held_from_last < len(window):
                    end -= held_from_last + 1
                    break
            else:
                return end
        return first_block

    def allocate(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> list[BlockTransfer]:
        """Start planning the request's saves; return the blocks it loads, one transfer per group.

        Blocks found at lookup are not saved again. A request allocated again
        with no lookup in between has had an asynchronous load end; the
        blocks it loaded are saved unless this medium's lookup found them
        (another connector beside this one may have loaded them: vLLM's
        `MultiConnector` hands the others no external tokens). Raises
        `ValueError` when the engine asks for more external tokens than the
        lookup found, or gives block ids for another number of groups.
        """
        lookup = self._lookups.pop(request.request_id, None)
        # Allocated again with no lookup in between: after an asynchronous load.
        earlier = None if lookup is not None else self._save_cursors.get(request.request_id)
        if lookup is None:
            lookup = _Lookup(request.num_computed_tokens // self._block_size, 0, 0)
        self.lookup_hit_blocks += lookup.hit_blocks
        self.lookup_miss_blocks += lookup.candidate_blocks - lookup.hit_blocks
        self.load_blocks_capped += lookup.capped_blocks
        all_block_ids = self._copied(self._per_group(request.request_id, blocks.get_block_ids()))
        if self._saves:
            # Blocks before the local hit are shared, read-only; the rest will be written.
            for group_ids in all_block_ids:
                self._note_new(group_ids[lookup.first_block :])
        if earlier is not None:
            # The first allocation already said which blocks came from this medium.
            earlier.block_ids = all_block_ids
        else:
            first_unsaved = lookup.first_block + lookup.hit_blocks
            self._save_cursors[request.request_id] = _SaveCursor(
                request,
                [first_unsaved] * len(self._groups),
                all_block_ids,
                lookup.branch_windows,
                local_blocks=lookup.first_block,
            )
        num_blocks = num_external_tokens // self._block_size
        if num_blocks <= 0:
            return []
        if num_blocks > lookup.hit_blocks:
            raise ValueError(
                f"update_state_after_alloc: request {request.request_id!r} asks for "
                f"{num_external_tokens} external tokens, the lookup found "
                f"{lookup.hit_blocks * self._block_size}"
            )
        start, end = lookup.first_block, lookup.first_block + num_blocks
        loads = []
        for group in self._groups:
            needed = group.needed_positions(end)
            positions = range(max(start, needed.start), end)
            load = self._transfer(request, group, all_block_ids[group.index], positions)
            if load is not None:
                loads.append(load)
        return loads

    def loads_failed(self, block_ids: set[int]) -> None:
        """Plan to save again, once recomputed, the blocks whose loads failed, and those after.

        The engine computes a request again from its first failed block, in
        every group; the medium no longer holds a good copy of it (the
        connector drops a corrupt entry), so that block and the following
        ones are saved anew. The first failed block beyond the request's
        local hit, and every block after it, is never offered to that
        request again (see `look_up`), whichever connector loaded it:
        the engine may look the request up again at once (vLLM does after a
        failed asynchronous load, keeping the request at the head of its
        queue of requests that hold blocks), a load that failed for want of
        time or of a sound entry would fail again, and a new asynchronous
        load of it, from any medium, can stall vLLM's admission there when
        the KV cache is short (it reserves blocks for the loads queued
        behind the request, and stops at the first request it cannot admit).
        """
        if not block_ids:
            return
        for request_id, cursor in self._save_cursors.items():
            # By the request's block ids, not by what this planner loaded: in a
            # composite, another connector may have made the failed load.
            failed = [
                position
                for group_ids in cursor.block_ids
                for position, block_id in enumerate(group_ids)
                if block_id in block_ids and block_id != self._null_block
            ]
            if failed:
                first_failed = min(failed)
                cursor.next_block_to_save = [
                    min(position, first_failed) for position in cursor.next_block_to_save
                ]
                # Blocks of the local hit are reported with a failed request's
                # others (vLLM's adapter on a hybrid model): they loaded nothing.
                loaded = [position for position in failed if position >= cursor.local_blocks]
                if loaded:
                    self._remember_failed_load(request_id, min(loaded))

    def _remember_failed_load(self, request_id: str, position: int) -> None:
        starts = self._failed_load_starts
        starts[request_id] = min(position, starts.pop(request_id, position))
        if len(starts) > self._max_failed_load_requests:
            # Bounded whatever the engine forgets to finish: the oldest entry goes.
            del starts[next(iter(starts))]

    def failed_load_start(self, request_id: str) -> int | None:
        """The first block position no longer offered to `request_id`, if a load of it failed."""
        return self._failed_load_starts.get(request_id)

    def plan_saves(self, scheduler_output: SchedulerOutput) -> list[BlockTransfer]:
        """The blocks to save this step: per request with new full blocks, one per group."""
        if not self._saves:
            return []
        transfers: list[BlockTransfer] = []
        for item in scheduler_output.scheduled:
            cursor = self._save_cursors.get(item.request_id)
            if cursor is None:
                continue
            block_ids = self._copied(self._per_group(item.request_id, item.block_ids))
            for old, new in zip(cursor.block_ids, block_ids, strict=True):
                if new[: len(old)] == old:
                    self._note_new(new[len(old) :])
                else:  # a window slid (ids became null), or a rollback reallocated some
                    self._note_new([b for i, b in enumerate(new) if i >= len(old) or b != old[i]])
            cursor.block_ids = block_ids
            hashes = cursor.request.block_hashes
            # Only full blocks whose hash is known and whose KV exists after this step.
            tokens_after_step = item.num_computed_tokens + item.num_scheduled_tokens
            end = min(
                tokens_after_step // self._block_size,
                len(hashes),
                *(len(group_ids) for group_ids in cursor.block_ids),
            )
            context: tuple[int, ...] | None = None  # built once a group has blocks to save
            aligned = tokens_after_step == end * self._block_size
            for group in self._groups:
                start = cursor.next_block_to_save[group.index]
                sliding = self._window_aware and group.window_blocks is not None
                # A branch window may come due in a step that completes no new block.
                if end <= start and not (sliding and cursor.branch_windows.get(group.index)):
                    continue
                cursor.next_block_to_save[group.index] = max(start, end)
                positions: Sequence[int] = range(start, end)
                if sliding:
                    positions = self._sliding_save_positions(group, cursor, start, end, aligned)
                if context is None:
                    context = tuple(
                        block_id
                        for group_ids in cursor.block_ids
                        for block_id in group_ids[:end]
                        if block_id != self._null_block
                    )
                save = self._transfer(
                    cursor.request, group, cursor.block_ids[group.index], positions, context
                )
                if save is not None:
                    transfers.append(save)
        return transfers

    def _sliding_save_positions(
        self, group: CacheGroup, cursor: _SaveCursor, start: int, end: int, aligned: bool
    ) -> list[int]:
        """A sliding group's saves for a step ending at `end`; see the module docstring.

        Blocks that left the window are never read again, except by a later
        request whose hit ends where this one's prefix did.
        """
        window_start = group.needed_positions(end).start - (1 if aligned else 0)
        positions = range(max(start, window_start), end)
        branch = cursor.branch_windows.get(group.index)
        if not branch:
            return list(positions)
        computed = [p for p in branch if p < end]
        cursor.branch_windows[group.index] = [p for p in branch if p >= end]
        return sorted({*computed, *positions})

    def _transfer(
        self,
        request: Request,
        group: CacheGroup,
        block_ids: Sequence[int],
        positions: Sequence[int],
        context_block_ids: tuple[int, ...] = (),
    ) -> BlockTransfer | None:
        """The blocks at `positions` of one group, null blocks left out; None if none is left."""
        kept = [p for p in positions if block_ids[p] != self._null_block]
        if not kept:
            return None
        return BlockTransfer(
            request_id=request.request_id,
            block_ids=tuple(block_ids[p] for p in kept),
            block_hashes=tuple(request.block_hashes[p] for p in kept),
            context_block_ids=context_block_ids,
            group=group.index,
        )

    def _per_group(
        self, request_id: str, block_ids: tuple[Sequence[int], ...]
    ) -> tuple[Sequence[int], ...]:
        if len(block_ids) != len(self._groups):
            raise ValueError(
                f"request {request_id!r}: got block ids for {len(block_ids)} KV cache groups, "
                f"the kv_cache_config has {len(self._groups)}"
            )
        return block_ids

    def take_new_block_ids(self) -> set[int]:
        """Block ids given to a request since the last call, to be written: then reset.

        Only tracked when the engine saves. A block freed while a background
        save still reads it (a sliding window moved on, a request was
        preempted or finished) can be given to a request and overwritten by
        the very next step's loads or forward pass; the worker half drops
        any save still reading one of these ids before anything writes them,
        so a torn block is never stored under a valid checksum.
        """
        new, self._new_block_ids = self._new_block_ids, set()
        return new

    def _note_new(self, block_ids: Sequence[int]) -> None:
        self._new_block_ids.update(block_ids)
        if self._null_block is not None:
            self._new_block_ids.discard(self._null_block)

    @staticmethod
    def _copied(block_ids: tuple[Sequence[int], ...]) -> tuple[list[int], ...]:
        # The engine may reuse its lists; the planner compares against what it saw.
        return tuple(list(group_ids) for group_ids in block_ids)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's lookup and save plan."""
        self._lookups.pop(request_id, None)
        self._save_cursors.pop(request_id, None)
        self._failed_load_starts.pop(request_id, None)

    def take_lookup_counts(self) -> tuple[int, int, int]:
        """The hit, miss and capped block counts since the last call, then reset them."""
        counts = (self.lookup_hit_blocks, self.lookup_miss_blocks, self.load_blocks_capped)
        self.lookup_hit_blocks = self.lookup_miss_blocks = self.load_blocks_capped = 0
        return counts
