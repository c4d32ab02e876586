"""Every configuration at every pool size over one trace, each beside Belady's optimum."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import attrs

from kvwire.interface.types import BlockHash
from kvwire.registry import ConnectorRegistry
from kvwire.replay.belady import belady_hits
from kvwire.replay.pool import PoolReplay, replay_pool

POLICIES = ("lru", "s3fifo", "arc", "kvfifo")
SAVE_THRESHOLDS = (1, 2)


@attrs.frozen
class SweepRow:
    """One configuration of the pool at one size: its hit rate, and the best any could have."""

    policy: str
    save_threshold: int
    pool_blocks: int
    hit_rate: float
    belady_hit_rate: float
    ratio: float | None
    """`hit_rate` over `belady_hit_rate`; None when the optimum hits nothing."""
    blocks_written: int
    """Blocks saved into the pool."""
    hit_blocks: int
    asked_blocks: int
    evicted_blocks: int
    saves_not_admitted: int
    seconds: float


def sweep(
    trace: Sequence[Sequence[BlockHash]],
    pool_sizes: Sequence[int],
    *,
    policies: Sequence[str] = POLICIES,
    save_thresholds: Sequence[int] = SAVE_THRESHOLDS,
    registry: ConnectorRegistry | None = None,
    on_replayed: Callable[[PoolReplay], None] | None = None,
) -> list[SweepRow]:
    """A row per pool size, policy and save threshold, in that order (`on_replayed` after each)."""
    accesses = [block for hashes in trace for block in hashes]
    rows = []
    for pool_blocks in pool_sizes:
        optimum = belady_hits(accesses, pool_blocks) / len(accesses) if accesses else 0.0
        for policy, threshold in itertools.product(policies, save_thresholds):
            replay = replay_pool(trace, pool_blocks, policy, threshold, registry=registry)
            if on_replayed is not None:
                on_replayed(replay)
            rows.append(
                SweepRow(
                    policy=policy,
                    save_threshold=threshold,
                    pool_blocks=pool_blocks,
                    hit_rate=replay.hit_rate,
                    belady_hit_rate=optimum,
                    ratio=replay.hit_rate / optimum if optimum else None,
                    blocks_written=replay.saved_blocks,
                    hit_blocks=replay.hit_blocks,
                    asked_blocks=replay.asked_blocks,
                    evicted_blocks=replay.evicted_blocks,
                    saves_not_admitted=replay.saves_not_admitted,
                    seconds=replay.seconds,
                )
            )
    return rows
