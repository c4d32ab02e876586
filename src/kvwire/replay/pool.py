"""A trace through the CPU pool's own index, as the offload connector drives it.

The index (`kvwire.media.cpu_pool.index.CPUPoolIndex`) is built as the
medium builds it: the eviction policy its `eviction` option names, from the
registry, and the admission its `save_threshold` option sets. For each
request, in order: a lookup of the prefix the pool holds, a load of it, and a
save of the rest (each save completes before the next request: the replay
measures what the pool keeps, not how fast it copies).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvwire.interface.types import BlockHash
from kvwire.media.cpu_pool.index import CPUPoolIndex
from kvwire.media.cpu_pool.medium import save_admission
from kvwire.registry import ConnectorRegistry, default_registry

# The pool's own name in its KV cache events, which the replay drops.
_MEDIUM = "cpu"

SaveChoice = Callable[[int, Sequence[BlockHash]], Sequence[BlockHash]]
"""Given a request's position in the trace and the blocks after its held prefix, those to save.

A what-if for a replay (an admission that knows something the pool cannot):
its result must be a prefix of the blocks it is given, as a save is.
"""


@attrs.frozen
class PoolReplay:
    """What a pool of `pool_blocks` blocks did over a trace, in blocks."""

    eviction: str
    save_threshold: int
    pool_blocks: int
    asked_blocks: int
    """Blocks the requests' prompts asked for."""
    hit_blocks: int
    """Blocks loaded from the pool: each request's prefix the pool held."""
    saved_blocks: int
    """Blocks written to the pool."""
    evicted_blocks: int
    saves_not_admitted: int
    seconds: float
    """How long the replay took."""

    @property
    def hit_rate(self) -> float:
        """Blocks loaded from the pool over blocks asked for (0 when none were)."""
        return self.hit_blocks / self.asked_blocks if self.asked_blocks else 0.0


def replay_pool(
    trace: Iterable[Sequence[BlockHash]],
    pool_blocks: int,
    eviction: str,
    save_threshold: int,
    *,
    registry: ConnectorRegistry | None = None,
    choose_saves: SaveChoice | None = None,
) -> PoolReplay:
    """Each request's block hashes, in order, through a pool of `pool_blocks` blocks.

    `eviction` names a policy of `registry.eviction_policies` (the default
    registry's when None): `lru`, `s3fifo`, `arc`, `kvfifo` or a plug-in's.
    `choose_saves`, when given, picks which of each request's missed blocks
    are offered to the pool (its admission still applies); all of them when None.
    """
    registry = registry or default_registry()
    index = CPUPoolIndex(
        pool_blocks,
        1,
        _MEDIUM,
        policy=registry.eviction_policies.get_class(eviction)(pool_blocks),
        admission=save_admission(save_threshold, pool_blocks),
        # The replay has no use for them: the index does not make them.
        keep_events=False,
    )
    asked = hits = saved = 0
    started = time.perf_counter()
    for position, hashes in enumerate(trace):
        asked += len(hashes)
        held = index.count_held_prefix(0, hashes)
        if held:
            prefix = hashes[:held]
            index.prepare_load(0, prefix)
            index.complete_load(0, prefix, ())
            hits += held
        missed = hashes[held:]
        if choose_saves is not None:
            chosen = choose_saves(position, missed)
            if list(chosen) != list(missed[: len(chosen)]):
                raise ValueError(
                    f"choose_saves: request {position}'s saves must be a prefix of its "
                    f"{len(missed)} missed blocks, as a save is"
                )
            missed = chosen
        placed = [block for block, _ in index.prepare_save(0, missed)]
        if placed:
            index.complete_save(0, placed, success=True)
            saved += len(placed)
    # The counts add up over the whole trace: taken once, at its end.
    counters = index.take_counters()
    return PoolReplay(
        eviction=eviction,
        save_threshold=save_threshold,
        pool_blocks=pool_blocks,
        asked_blocks=asked,
        hit_blocks=hits,
        saved_blocks=saved,
        evicted_blocks=counters.get("evicted_blocks", 0),
        saves_not_admitted=counters.get("saves_not_admitted", 0),
        seconds=time.perf_counter() - started,
    )
