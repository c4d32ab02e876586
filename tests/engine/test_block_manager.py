"""The block pool: allocation, the local prefix cache and its LRU eviction."""

from __future__ import annotations

from kvwire.engine.block_hash import extend_block_hashes
from kvwire.engine.block_manager import BlockManager
from kvwire.interface.types import Request


def _request(request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id=request_id, prompt_token_ids=tokens, max_tokens=1)
    extend_block_hashes(request.block_hashes, tokens, block_size=4, root=b"root")
    return request


def _compute_and_free(manager: BlockManager, request: Request) -> list[int]:
    manager.allocate(request, [], request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    blocks = list(manager.group_blocks_of(request.request_id)[0])
    manager.free(request.request_id)
    return blocks


def test_a_repeated_prefix_is_found_in_the_local_cache() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    blocks = _compute_and_free(manager, _request("a", list(range(12))))
    cached, tokens = manager.find_cached_prefix(_request("b", [*range(8), 50, 51, 52]))
    assert cached == (blocks[:2],) and tokens == 8


def test_a_fully_cached_prompt_leaves_its_last_block_to_compute() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    _compute_and_free(manager, _request("a", list(range(8))))
    _cached, tokens = manager.find_cached_prefix(_request("b", list(range(8))))
    assert tokens == 4


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    manager = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    assert manager.allocate(_request("a", list(range(16))), [], 16) is None
    assert manager.num_free_blocks == 3 and manager.group_blocks_of("a")[0] == []


def test_eviction_takes_the_least_recently_freed_block_and_forgets_its_hash() -> None:
    manager = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    first = _request("a", list(range(8)))
    _compute_and_free(manager, first)  # blocks 0, 1 cached and free; block 2 never used
    manager.allocate(_request("b", [90] * 8), [], 8)  # takes block 2, then evicts one
    _cached, tokens = manager.find_cached_prefix(_request("c", [*range(8), 1]))
    assert tokens == 4  # the prefix's tail block went first, its head survived


def test_invalidated_blocks_are_no_longer_prefix_hits() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    blocks = _compute_and_free(manager, _request("a", list(range(12))))
    manager.invalidate([blocks[1]])
    _cached, tokens = manager.find_cached_prefix(_request("b", list(range(12))))
    assert tokens == 4


def test_prefix_caching_off_never_reports_local_hits() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    _compute_and_free(manager, _request("a", list(range(12))))
    assert manager.find_cached_prefix(_request("b", list(range(12)))) == (([],), 0)


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    manager.allocate(_request("a", list(range(4))), [], 4)
    assert manager.reset_prefix_cache() is False
    manager.free("a")
    assert manager.reset_prefix_cache() is True


def test_blocks_published_before_they_are_computed_are_found_by_the_next_request() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = _request("a", list(range(12)))
    manager.allocate(first, [], first.num_tokens)
    manager.cache_full_blocks(first, num_tokens=8)  # scheduled, not yet computed
    _cached, tokens = manager.find_cached_prefix(_request("b", list(range(12))))
    assert tokens == 8


def test_rolled_back_blocks_leave_the_prefix_cache() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = _request("a", list(range(13)))
    manager.allocate(first, [], first.num_tokens)
    manager.cache_full_blocks(first, num_tokens=12)
    manager.uncache_from("a", 1)
    _cached, tokens = manager.find_cached_prefix(_request("b", list(range(13))))
    assert tokens == 4
