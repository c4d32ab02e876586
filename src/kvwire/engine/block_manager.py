"""The engine's block pool and its local prefix cache.

Every block has a reference count. A block whose count drops to zero goes to
the back of an LRU queue of free blocks but keeps its contents and its hash,
so a later request with the same prefix can take it back (a local prefix-cache
hit); a new allocation takes the least recently freed block and forgets its
hash (eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvwire.connector.types import BlockHash, KVCacheBlocks, Request


class BlockManager:
    """Allocates cache blocks to requests and keeps the local prefix cache.

    ``enable_prefix_caching=False`` turns local hits off; hashes are still
    kept for the connector, which decides by them what to load and save.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        # Free blocks, least recently freed first; values unused.
        self._free: OrderedDict[int, None] = OrderedDict(
            (block, None) for block in range(num_blocks)
        )
        self._request_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_of(self, request_id: str) -> list[int]:
        return self._request_blocks.get(request_id, [])

    def kv_cache_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks((list(self.blocks_of(request_id)),))

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The locally cached blocks of ``request``'s longest known prefix, and its tokens.

        At least one token is always left to compute, since the step that
        computes it produces the next token's logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate(
        self, request: Request, cached_blocks: list[int], num_tokens_total: int
    ) -> KVCacheBlocks | None:
        """Give ``request`` enough blocks to hold ``num_tokens_total`` tokens.

        ``cached_blocks`` (from :meth:`find_cached_prefix`, only for a request
        that holds no blocks yet) are taken first. None, and nothing changed,
        when the pool is short.
        """
        held = self._request_blocks.setdefault(request.request_id, [])
        needed = -(-num_tokens_total // self.block_size) - len(held) - len(cached_blocks)
        reusable_free = sum(1 for block in cached_blocks if self._ref_counts[block] == 0)
        if needed > len(self._free) - reusable_free:
            if not held:
                del self._request_blocks[request.request_id]
            return None
        for block in cached_blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        held.extend(cached_blocks)
        if cached_blocks:
            self._num_cached_blocks[request.request_id] = len(held)
        for _ in range(max(needed, 0)):
            block, _unused = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            held.append(block)
        return KVCacheBlocks((list(held),))

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Publish the request's full blocks of its first ``num_tokens`` tokens.

        ``num_tokens`` (default: the computed tokens) may count tokens that
        this step computes or loads synchronously: their keys and values are
        in the cache before any attention of the step reads them, so a request
        admitted later in the same step can share the blocks.
        """
        held = self._request_blocks.get(request.request_id)
        if not held:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks.get(request.request_id, 0)
        for index in range(start, num_full):
            block = held[index]
            block_hash = request.block_hashes[index]
            if self._block_hash[block] is None and block_hash not in self._cached:
                self._block_hash[block] = block_hash
                self._cached[block_hash] = block
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def uncache_from(self, request_id: str, block_index: int) -> None:
        """Take the request's blocks from ``block_index`` on out of the prefix cache.

        For a rollback: those blocks were computed from (or are) bad data, so
        no request may hit them until they are computed again.
        """
        num_cached = self._num_cached_blocks.get(request_id, 0)
        if num_cached > block_index:
            self.invalidate(self._request_blocks.get(request_id, [])[block_index:num_cached])
            self._num_cached_blocks[request_id] = block_index

    def invalidate(self, block_ids: Iterable[int]) -> None:
        """Drop blocks whose contents are wrong (a failed load) from the prefix cache."""
        for block in block_ids:
            self._evict(block)

    def free(self, request_id: str) -> None:
        """Release the request's blocks; the tail goes first into the LRU.

        Freeing in reverse order makes a prefix's later blocks older than its
        first ones, so eviction eats prefixes from their ends.
        """
        held = self._request_blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        for block in reversed(held):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while blocks are in use."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    def _evict(self, block: int) -> None:
        block_hash = self._block_hash[block]
        if block_hash is not None:
            self._block_hash[block] = None
            if self._cached.get(block_hash) == block:
                del self._cached[block_hash]
