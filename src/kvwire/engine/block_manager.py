"""The engine's block pool and its local prefix cache, for one or more KV cache groups.

Every block has a reference count. A block whose count drops to zero goes to
the back of an LRU queue of free blocks but keeps its contents and its hash,
so a later request with the same prefix can take it back (a local prefix-cache
hit); a new allocation takes the least recently freed block and forgets its
hash (eviction).

Several groups (the hybrid KV cache manager: full-attention layers beside
sliding-window ones) draw from the one pool, so a block id names one block
of one group at a time. Each request holds, per group, a list aligned with
its positions: entry `i` holds tokens `[i * block_size, (i + 1) *
block_size)`. A sliding-window group gives back the blocks that left its
window and holds the null block (id 0, never allocated) in their place. The
prefix cache is keyed by (group, block hash).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvwire.interface.types import BlockHash, KVCacheBlocks, Request

NULL_BLOCK = 0
"""The block a sliding-window group holds for positions outside its window (hybrid pools only)."""


def window_blocks(sliding_window: int, block_size: int) -> int:
    """How many full blocks before position `n * block_size` its attention still reads.

    The token at position p attends `[p - window + 1, p]`, so after `n`
    full blocks only blocks `[n - w, n)` are still needed, `w =
    ceil((window - 1) / block_size)`.
    """
    return -(-(sliding_window - 1) // block_size)


class BlockManager:
    """Allocates cache blocks to requests and keeps the local prefix cache.

    `enable_prefix_caching=False` turns local hits off; hashes are still
    kept for the connector, which decides by them what to load and save.
    `group_windows` has one entry per KV cache group: its sliding window in
    tokens, or None for full attention. When any group has a window, block
    id 0 is the null block and never allocated.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        if not group_windows:
            raise ValueError("group_windows must name at least one KV cache group")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        # Per group: blocks before the prefix end still read (None: all of them).
        self._window_blocks = tuple(
            None if window is None else window_blocks(window, block_size)
            for window in self.group_windows
        )
        self.uses_null_block = any(window is not None for window in self.group_windows)
        first_block = NULL_BLOCK + 1 if self.uses_null_block else 0
        if num_blocks <= first_block:
            raise ValueError(
                f"num_gpu_blocks must be > {first_block} (block 0 is the null block of a hybrid "
                f"KV cache), got {num_blocks}"
            )
        self.num_usable_blocks = num_blocks - first_block
        self._ref_counts = [0] * num_blocks
        self._block_key: list[tuple[int, BlockHash] | None] = [None] * num_blocks
        self._cached: dict[tuple[int, BlockHash], int] = {}
        # Free blocks, least recently freed first; values unused.
        self._free: OrderedDict[int, None] = OrderedDict(
            (block, None) for block in range(first_block, num_blocks)
        )
        self._request_blocks: dict[str, list[list[int]]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def group_blocks_of(self, request_id: str) -> tuple[list[int], ...]:
        """Copies of the request's block lists, one per group."""
        held = self._request_blocks.get(request_id)
        if not held:
            return tuple([] for _ in range(self.num_groups))
        return tuple(list(blocks) for blocks in held)

    def real_blocks_of(self, request_id: str) -> set[int]:
        """Every block the request holds, in any group (the null block left out)."""
        held = self._request_blocks.get(request_id) or []
        return {block for blocks in held for block in blocks if not self._is_null(block)}

    def find_cached_prefix(self, request: Request) -> tuple[tuple[list[int], ...], int]:
        """The locally cached blocks of `request`'s longest known prefix, and its tokens.

        The prefix is the longest number `n` of full blocks valid in every
        group: a full group has blocks `[0, n)` cached, a sliding-window
        group those of its window, `[max(0, n - w), n)`; below its window
        it gets null blocks. At least one token is always left to compute,
        since the step that computes it produces the next token's logits.
        """
        empty: tuple[list[int], ...] = tuple([] for _ in range(self.num_groups))
        if not self.enable_prefix_caching:
            return empty, 0
        limit = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        # Full groups: a prefix valid for n is valid for any shorter one.
        for group, window in enumerate(self._window_blocks):
            if window is None:
                limit = self._cached_run(group, hashes, limit)
        # Sliding groups are not monotone (a shorter prefix may need a block
        # the longer one does not), so shrink until every group agrees.
        changed = True
        while changed and limit > 0:
            changed = False
            for group, window in enumerate(self._window_blocks):
                if window is not None:
                    end = self._sliding_end(group, hashes, limit, window)
                    changed |= end != limit
                    limit = end
        if limit == 0:
            return empty, 0
        prefix = []
        for group, window in enumerate(self._window_blocks):
            start = 0 if window is None else max(0, limit - window)
            blocks = [NULL_BLOCK] * start
            blocks += [self._cached[(group, block_hash)] for block_hash in hashes[start:limit]]
            prefix.append(blocks)
        return tuple(prefix), limit * self.block_size

    def allocate(
        self,
        request: Request,
        cached_blocks: Sequence[list[int]],
        num_tokens_total: int,
        num_computed_tokens: int | None = None,
    ) -> KVCacheBlocks | None:
        """Give `request` enough blocks to hold `num_tokens_total` tokens.

        `cached_blocks` (per group, from `find_cached_prefix`, only
        for a request that holds no blocks yet; empty for none) are taken
        first. `num_computed_tokens` (default: the request's) are known
        before this allocation's work: a sliding-window group first gives
        back the blocks that left the window of what comes after them, and
        gets null blocks for positions below it. None, and nothing else
        changed, when the pool is short.
        """
        held = self._request_blocks.get(request.request_id)
        is_new = held is None
        if held is None:
            held = [[] for _ in range(self.num_groups)]
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        self._free_skipped(held, num_computed_tokens)
        cached = [list(blocks) for blocks in cached_blocks] if cached_blocks else []
        num_target = -(-num_tokens_total // self.block_size)
        needed = reusable_free = 0
        for group, blocks in enumerate(held):
            skipped = self._num_skipped(group, num_computed_tokens)
            if cached:
                # A cached block already out of the window is not taken at all.
                cached[group][:skipped] = [NULL_BLOCK] * min(skipped, len(cached[group]))
                reusable_free += sum(
                    1
                    for block in cached[group]
                    if not self._is_null(block) and self._ref_counts[block] == 0
                )
            # Cached blocks come only for a request that holds none yet.
            needed += self._num_missing(
                group, cached[group] if cached else blocks, skipped, num_target
            )
        if needed > len(self._free) - reusable_free:
            return None
        if is_new:
            self._request_blocks[request.request_id] = held
        for group, blocks in enumerate(held):
            for block in cached[group] if cached else ():
                if not self._is_null(block):
                    if self._ref_counts[block] == 0:
                        del self._free[block]
                    self._ref_counts[block] += 1
                blocks.append(block)
        if cached:
            self._num_cached_blocks[request.request_id] = len(held[0])
        for group, blocks in enumerate(held):
            self._fill(group, blocks, self._num_skipped(group, num_computed_tokens), num_target)
        return KVCacheBlocks(tuple(list(blocks) for blocks in held))

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Publish the request's full blocks of its first `num_tokens` tokens.

        `num_tokens` (default: the computed tokens) may count tokens that
        this step computes or loads synchronously: their keys and values are
        in the cache before any attention of the step reads them, so a request
        admitted later in the same step can share the blocks.
        """
        held = self._request_blocks.get(request.request_id)
        if not held or not held[0]:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(held[0]))
        start = self._num_cached_blocks.get(request.request_id, 0)
        for group, blocks in enumerate(held):
            for index in range(start, num_full):
                block = blocks[index]
                key = (group, request.block_hashes[index])
                if (
                    not self._is_null(block)
                    and self._block_key[block] is None
                    and key not in self._cached
                ):
                    self._block_key[block] = key
                    self._cached[key] = block
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def valid_prefix_blocks(self, request_id: str, limit: int) -> int:
        """The most full blocks, at most `limit`, whose contents every group still holds.

        After a failed load rolls a request back, a sliding-window group may
        have given back blocks the shorter prefix needs again; the request
        can resume only where every group holds its window.
        """
        held = self._request_blocks.get(request_id)
        if not held:
            return 0
        for group, window in enumerate(self._window_blocks):
            if window is None:
                continue
            blocks = held[group]
            present = [
                index < len(blocks) and not self._is_null(blocks[index]) for index in range(limit)
            ]
            limit = _longest_valid_end(present, limit, window)
        return limit

    def own_blocks_from(self, request_id: str, block_index: int) -> set[int]:
        """The request's blocks at positions from `block_index` on that no other request holds."""
        return {
            block
            for blocks in self._request_blocks.get(request_id, [])
            for block in blocks[block_index:]
            if not self._is_null(block) and self._ref_counts[block] == 1
        }

    def uncache_from(self, request_id: str, block_index: int) -> None:
        """Take the request's blocks from `block_index` on out of the prefix cache.

        For a rollback: those blocks were computed from (or are) bad data, so
        no request may hit them until they are computed again.
        """
        num_cached = self._num_cached_blocks.get(request_id, 0)
        if num_cached > block_index:
            for blocks in self._request_blocks.get(request_id, []):
                self.invalidate(blocks[block_index:num_cached])
            self._num_cached_blocks[request_id] = block_index

    def invalidate(self, block_ids: Iterable[int]) -> None:
        """Drop blocks whose contents are wrong (a failed load) from the prefix cache."""
        for block in block_ids:
            if not self._is_null(block):
                self._evict(block)

    def free(self, request_id: str) -> None:
        """Release the request's blocks; the tail goes first into the LRU.

        Freeing in reverse order of position makes a prefix's later blocks
        older than its first ones, so eviction eats prefixes from their ends.
        """
        held = self._request_blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        length = max((len(blocks) for blocks in held), default=0)
        for index in reversed(range(length)):
            for blocks in held:
                if index < len(blocks):
                    self._release(blocks[index])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while blocks are in use."""
        if len(self._free) != self.num_usable_blocks:
            return False
        self._cached.clear()
        self._block_key = [None] * self.num_blocks
        return True

    # ------------------------------------------------------------ internals

    def _is_null(self, block: int) -> bool:
        return self.uses_null_block and block == NULL_BLOCK

    def _num_skipped(self, group: int, num_computed_tokens: int) -> int:
        """Leading blocks of `group` no attention after `num_computed_tokens` reads."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, (num_computed_tokens - window + 1) // self.block_size)

    def _free_skipped(self, held: list[list[int]], num_computed_tokens: int) -> None:
        for group, blocks in enumerate(held):
            # Freed blocks form a prefix: walk back from the window's start
            # until the first block given back earlier.
            index = min(self._num_skipped(group, num_computed_tokens), len(blocks)) - 1
            while index >= 0 and not self._is_null(blocks[index]):
                self._release(blocks[index])
                blocks[index] = NULL_BLOCK
                index -= 1

    def _num_missing(self, group: int, blocks: list[int], skipped: int, num_target: int) -> int:
        """Blocks to take so that `blocks` covers `num_target` positions from `skipped` on."""
        missing = max(0, num_target - max(len(blocks), skipped))
        if self.group_windows[group] is None:
            return missing  # a full group holds no null block
        # Between a sliding group's skipped prefix and its end lie at most a
        # window and a chunk: cheap to scan for nulls (left by a rollback).
        end = min(len(blocks), num_target)
        return missing + sum(1 for index in range(skipped, end) if self._is_null(blocks[index]))

    def _fill(self, group: int, blocks: list[int], skipped: int, num_target: int) -> None:
        """Give `blocks` real blocks at positions `[skipped, num_target)`, null below."""
        if self.group_windows[group] is not None:
            for index in range(skipped, min(len(blocks), num_target)):
                if self._is_null(blocks[index]):
                    blocks[index] = self._take_free_block()  # after a rollback
        if len(blocks) < skipped:
            blocks.extend([NULL_BLOCK] * (min(skipped, num_target) - len(blocks)))
        for _ in range(len(blocks), num_target):
            blocks.append(self._take_free_block())

    def _release(self, block: int) -> None:
        if self._is_null(block):
            return
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None

    def _take_free_block(self) -> int:
        block, _unused = self._free.popitem(last=False)
        self._evict(block)
        self._ref_counts[block] = 1
        return block

    def _cached_run(self, group: int, hashes: Sequence[BlockHash], limit: int) -> int:
        """How many of the first `limit` blocks `group` has cached, from the start."""
        for index in range(limit):
            if (group, hashes[index]) not in self._cached:
                return index
        return limit

    def _sliding_end(self, group: int, hashes: Sequence[BlockHash], limit: int, window: int) -> int:
        present = [(group, hashes[index]) in self._cached for index in range(limit)]
        return _longest_valid_end(present, limit, window)

    def _evict(self, block: int) -> None:
        key = self._block_key[block]
        if key is not None:
            self._block_key[block] = None
            if self._cached.get(key) == block:
                del self._cached[key]


def _longest_valid_end(present: Sequence[bool], limit: int, window: int) -> int:
    """The largest `n <= limit` with `present[max(0, n - window):n]` all true."""
    end = limit
    for index in range(limit - 1, -1, -1):
        if end - index > window:
            return end  # blocks [end - window, end) are all present
        if not present[index]:
            end = index
    return end
