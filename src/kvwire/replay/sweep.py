"""Every configuration at every pool size over one trace, each beside Belady's optimum.

Each configuration replays the whole trace on its own, so `jobs` worker
processes replay several at once (each gets the trace once); the rows come
back in the same order whatever the number of workers.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
from collections.abc import Callable, Sequence

import attrs

from kvwire.interface.types import BlockHash
from kvwire.registry import ConnectorRegistry
from kvwire.replay.belady import belady_hit_counts
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
    jobs: int = 1,
) -> list[SweepRow]:
    """A row per pool size, policy and save threshold, in that order (`on_replayed` after each).

    With `jobs` above 1, that many worker processes replay the
    configurations; they name policies through the default registry, so
    `registry` must then be None (a registry of one's own stays in this process).
    """
    if jobs < 1:
        raise ValueError(f"jobs is the number of worker processes, >= 1; got {jobs}")
    if jobs > 1 and registry is not None:
        raise ValueError(
            "a sweep with jobs > 1 replays in worker processes, which name policies through "
            "the default registry; pass registry=None, or jobs=1 to use this registry"
        )
    accesses = [block for hashes in trace for block in hashes]
    configurations = [
        (pool_blocks, policy, threshold)
        for pool_blocks in pool_sizes
        for policy, threshold in itertools.product(policies, save_thresholds)
    ]
    replays: list[PoolReplay | None] = [None] * len(configurations)

    def replayed(position: int, replay: PoolReplay) -> None:
        replays[position] = replay
        if on_replayed is not None:
            on_replayed(replay)

    if jobs == 1 or len(configurations) == 1:
        for position, (pool_blocks, policy, threshold) in enumerate(configurations):
            replayed(
                position, replay_pool(trace, pool_blocks, policy, threshold, registry=registry)
            )
    else:
        _replay_in_workers(trace, configurations, min(jobs, len(configurations)), replayed)
    optima = {
        pool_blocks: hits / len(accesses) if accesses else 0.0
        for pool_blocks, hits in belady_hit_counts(accesses, pool_sizes).items()
    }
    return [_row(replay, optima[replay.pool_blocks]) for replay in replays if replay is not None]


def _row(replay: PoolReplay, optimum: float) -> SweepRow:
    return SweepRow(
        policy=replay.eviction,
        save_threshold=replay.save_threshold,
        pool_blocks=replay.pool_blocks,
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


# The trace a worker process replays, set once per worker by its initializer.
_worker_trace: Sequence[Sequence[BlockHash]] = ()


def _keep_trace(trace: Sequence[Sequence[BlockHash]]) -> None:
    global _worker_trace
    _worker_trace = trace


def _replay_one(pool_blocks: int, policy: str, threshold: int) -> PoolReplay:
    return replay_pool(_worker_trace, pool_blocks, policy, threshold)


def _replay_in_workers(
    trace: Sequence[Sequence[BlockHash]],
    configurations: Sequence[tuple[int, str, int]],
    jobs: int,
    replayed: Callable[[int, PoolReplay], None],
) -> None:
    """Each configuration in one of `jobs` fresh processes (spawned: nothing inherited)."""
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_keep_trace,
        initargs=([tuple(hashes) for hashes in trace],),
    ) as pool:
        futures = {
            pool.submit(_replay_one, *configuration): position
            for position, configuration in enumerate(configurations)
        }
        for future in concurrent.futures.as_completed(futures):
            replayed(futures[future], future.result())
