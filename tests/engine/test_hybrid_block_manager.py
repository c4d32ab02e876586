"""The block pool with several KV cache groups: a full one and a sliding-window one.

Window 8 on blocks of 4: after n full blocks a sliding group still needs
blocks [n - 2, n) (w = ceil((8 - 1) / 4) = 2).
"""

from __future__ import annotations

from kvwire.engine.block_hash import extend_block_hashes
from kvwire.engine.block_manager import NULL_BLOCK, BlockManager
from kvwire.interface.types import Request

FULL, SLIDING = 0, 1


def _manager(num_blocks: int = 32, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, 4, prefix_caching, group_windows=(None, 8))


def _request(request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id=request_id, prompt_token_ids=tokens, max_tokens=1)
    extend_block_hashes(request.block_hashes, tokens, block_size=4, root=b"root")
    return request


def _compute(manager: BlockManager, request: Request) -> tuple[list[int], ...]:
    """Allocate and compute the whole prompt in one step, publish its blocks."""
    blocks = manager.allocate(request, [], request.num_tokens)
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return blocks.get_block_ids()


def test_the_null_block_is_never_allocated_and_ids_are_unique_across_groups() -> None:
    manager = _manager(num_blocks=9)
    assert manager.num_free_blocks == 8
    blocks = _compute(manager, _request("a", list(range(16))))
    ids = blocks[FULL] + blocks[SLIDING]
    assert NULL_BLOCK not in ids and len(set(ids)) == 8
    assert manager.num_free_blocks == 0


def test_a_sliding_group_frees_the_blocks_that_left_its_window_before_allocating() -> None:
    manager = _manager()
    request = _request("a", list(range(24)))
    _compute(manager, request)
    free_before = manager.num_free_blocks
    sliding_before = list(manager.group_blocks_of("a")[SLIDING])
    # The next step (one token at position 24) attends positions [17, 24]:
    # blocks 0..3 (tokens 0..15) are no longer read.
    blocks = manager.allocate(request, [], 25)
    assert blocks is not None
    sliding = blocks.get_block_ids()[SLIDING]
    assert sliding[:4] == [NULL_BLOCK] * 4 and sliding[4:6] == sliding_before[4:6]
    assert blocks.get_block_ids()[FULL][:6] == manager.group_blocks_of("a")[FULL][:6]
    # Four given back, two new ones (block 6 in each group).
    assert manager.num_free_blocks == free_before + 4 - 2


def test_a_hit_is_the_longest_prefix_valid_in_every_group_with_nulls_below_the_window() -> None:
    manager = _manager()
    first = _request("a", list(range(24)))
    _compute(manager, first)
    manager.free("a")
    cached, tokens = manager.find_cached_prefix(_request("b", [*range(24), 99]))
    assert tokens == 24 and len(cached[FULL]) == 6
    assert cached[SLIDING][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in cached[SLIDING][4:]


def test_a_sliding_block_missing_inside_the_window_shortens_the_hit() -> None:
    manager = _manager()
    first = _request("a", list(range(24)))
    blocks = _compute(manager, first)
    manager.free("a")
    # Block 5 of the sliding group is gone: a prefix of 6 blocks needs its
    # blocks 4 and 5, one of 5 blocks needs 3 and 4 (the full group holds all).
    manager.invalidate([blocks[SLIDING][5]])
    _cached, tokens = manager.find_cached_prefix(_request("b", [*range(24), 99]))
    assert tokens == 5 * 4


def test_sliding_blocks_below_the_window_do_not_matter_for_a_hit() -> None:
    manager = _manager()
    first = _request("a", list(range(24)))
    blocks = _compute(manager, first)
    manager.free("a")
    manager.invalidate(blocks[SLIDING][:2])
    _cached, tokens = manager.find_cached_prefix(_request("b", [*range(24), 99]))
    assert tokens == 24
    # The full group is a prefix: a hole at block 4 caps the hit at 4
    # blocks, whose sliding window (blocks 2, 3) is still cached.
    manager.invalidate([blocks[FULL][4]])
    _cached, tokens = manager.find_cached_prefix(_request("c", [*range(24), 99]))
    assert tokens == 4 * 4


def test_taking_a_hit_takes_only_the_in_window_sliding_blocks() -> None:
    manager = _manager()
    _compute(manager, _request("a", list(range(24))))
    manager.free("a")
    free_before = manager.num_free_blocks
    second = _request("b", [*range(24), 99])
    cached, tokens = manager.find_cached_prefix(second)
    blocks = manager.allocate(second, cached, second.num_tokens, tokens)
    assert blocks is not None
    full, sliding = blocks.get_block_ids()
    assert full[:6] == cached[FULL] and sliding[:6] == cached[SLIDING]
    # Taken back from the free list: 6 full + 2 sliding; new: block 6 of each.
    assert manager.num_free_blocks == free_before - 8 - 2


def test_the_groups_draw_from_one_pool() -> None:
    manager = _manager(num_blocks=8)  # seven usable blocks
    request = _request("a", list(range(12)))
    _compute(manager, request)  # 3 + 3 blocks
    assert manager.num_free_blocks == 1
    assert manager.allocate(request, [], 17) is None  # 2 per group needed, 2 free
    # At 12 computed tokens the sliding group needs only blocks [1, 3): its
    # block 0 went back to the pool (even though the allocation failed).
    sliding_first = manager.group_blocks_of("a")[SLIDING][0]
    assert sliding_first == NULL_BLOCK and manager.num_free_blocks == 2
    blocks = manager.allocate(request, [], 13)
    assert blocks is not None and manager.num_free_blocks == 0
    full, sliding = blocks.get_block_ids()
    real = [block for block in full + sliding if block != NULL_BLOCK]
    assert len(real) == len(set(real)) == 7


def test_a_rollback_resumes_only_where_every_group_still_holds_its_window() -> None:
    manager = _manager()
    request = _request("a", [*range(24), 99])
    blocks = manager.allocate(request, [], 25, num_computed_tokens=24)
    assert blocks is not None
    # Loaded up to 24 tokens: the sliding group holds blocks 4, 5 only.
    assert blocks.get_block_ids()[SLIDING][:4] == [NULL_BLOCK] * 4
    assert manager.valid_prefix_blocks("a", 6) == 6
    # A failed block at 5 rolls back to 5, whose window (3, 4) lacks block 3:
    # the request can resume at 0 (the sliding group then recomputes all).
    assert manager.valid_prefix_blocks("a", 5) == 0
    # Recomputing from 0 gets real blocks again where nulls were.
    again = manager.allocate(request, [], 25, num_computed_tokens=0)
    assert again is not None
    assert NULL_BLOCK not in again.get_block_ids()[SLIDING]


def test_prefix_caching_off_never_reports_local_hits_in_any_group() -> None:
    manager = _manager(prefix_caching=False)
    _compute(manager, _request("a", list(range(24))))
    manager.free("a")
    assert manager.find_cached_prefix(_request("b", list(range(24)))) == (([], []), 0)


def test_a_reset_counts_the_pool_without_the_null_block() -> None:
    manager = _manager(num_blocks=9)
    _compute(manager, _request("a", list(range(8))))
    assert manager.reset_prefix_cache() is False
    manager.free("a")
    assert manager.reset_prefix_cache() is True
