"""Belady's offline optimum: the most hits any cache of a size could have on a sequence of blocks.

On a miss it keeps the block whose next use is soonest, evicting the block
used again farthest in the future, or not saving the new block when that
block is the new one itself (an optimum that may refuse saves, as admission
does). It counts every held block as a hit, where the pool counts only a held
prefix, so it bounds every policy's hits from above.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvwire.interface.types import BlockHash


def belady_hits(accesses: Sequence[BlockHash], capacity: int) -> int:
    """Hits of the offline optimum over `accesses` with `capacity` blocks (saves may be refused).

    On a miss the cache keeps the `capacity` blocks used again soonest among
    those it holds and the new one: it evicts the block whose next use is
    farthest, or does not keep the new block when that is the new one.
    """
    return belady_hit_counts(accesses, (capacity,))[capacity]


def belady_hit_counts(accesses: Sequence[BlockHash], capacities: Iterable[int]) -> dict[int, int]:
    """`belady_hits` at each of `capacities`, the next use of each access found once for all."""
    next_uses = _next_uses(accesses)
    return {capacity: _hits(next_uses, capacity) for capacity in capacities}


def _next_uses(accesses: Sequence[BlockHash]) -> list[int]:
    """Where each access's block is asked for next; `len(accesses)` for never."""
    never = len(accesses)
    next_use = [never] * len(accesses)
    last_seen: dict[BlockHash, int] = {}
    for position in range(len(accesses) - 1, -1, -1):
        block = accesses[position]
        next_use[position] = last_seen.get(block, never)
        last_seen[block] = position
    return next_use


def _hits(next_uses: Sequence[int], capacity: int) -> int:
    """Belady's hits, each held block known by its next use alone.

    A position is the next use of at most one earlier access, so the held
    blocks are a set of positions: the access at a position hits when that
    position is held, and the block to give up is the greatest one.
    """
    never = len(next_uses)
    held: set[int] = set()
    # Farthest next use first (negated); entries no longer held are skipped when met.
    farthest: list[int] = []
    hits = 0
    for position, upcoming in enumerate(next_uses):
        if position in held:
            hits += 1
            held.remove(position)
        elif len(held) >= capacity:
            while -farthest[0] not in held:
                heapq.heappop(farthest)
            if -farthest[0] <= upcoming:
                continue
            held.remove(-heapq.heappop(farthest))
        if upcoming != never:
            held.add(upcoming)
            heapq.heappush(farthest, -upcoming)
    return hits
