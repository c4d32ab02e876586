"""Belady's offline optimum: the most hits any cache of a size could have on a sequence of blocks.

On a miss it keeps the block whose next use is soonest, evicting the block
used again farthest in the future, or not saving the new block when that
block is the new one itself (an optimum that may refuse saves, as admission
does). It counts every held block as a hit, where the pool counts only a held
prefix, so it bounds every policy's hits from above.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvwire.interface.types import BlockHash


def belady_hits(accesses: Sequence[BlockHash], capacity: int) -> int:
    """Hits of the offline optimum over `accesses` with `capacity` blocks (saves may be refused).

    On a miss the cache keeps the `capacity` blocks used again soonest among
    those it holds and the new one: it evicts the block whose next use is
    farthest, or does not keep the new block when that is the new one.
    """
    never = len(accesses)
    next_use = [never] * len(accesses)
    last_seen: dict[BlockHash, int] = {}
    for position in range(len(accesses) - 1, -1, -1):
        block = accesses[position]
        next_use[position] = last_seen.get(block, never)
        last_seen[block] = position
    held: dict[BlockHash, int] = {}
    # Farthest next use first; entries whose block moved on are skipped when met.
    farthest: list[tuple[int, BlockHash]] = []
    hits = 0
    for position, block in enumerate(accesses):
        upcoming = next_use[position]
        if block in held:
            hits += 1
        elif len(held) >= capacity:
            while True:
                negated, candidate = farthest[0]
                if held.get(candidate) == -negated:
                    break
                heapq.heappop(farthest)
            if -negated <= upcoming:
                continue
            heapq.heappop(farthest)
            del held[candidate]
        if upcoming == never:
            held.pop(block, None)
            continue
        held[block] = upcoming
        heapq.heappush(farthest, (-upcoming, block))
    return hits
