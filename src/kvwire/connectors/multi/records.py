"""The records a MultiConnector sends between its halves: one entry per child, in child order.

The scheduler half's step metadata and the worker half's report cross
processes, so they are picklable; the stats keep each child's counters under
the child's name, rebuilt by the child's own stats class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from kvwire.interface.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from kvwire.interface.types import KVConnectorStats

if TYPE_CHECKING:
    from kvwire.interface.base import KVConnectorBase


@attrs.frozen
class MultiKVConnectorMetadata(KVConnectorMetadata):
    """Each child's metadata, in child order, and the extra saves to wait for.

    `extra_async_saves` maps a finished request to how many more children
    than one must report it finished sending before the engine may free it.
    """

    children: tuple[KVConnectorMetadata, ...]
    extra_async_saves: tuple[tuple[str, int], ...] = ()


@attrs.frozen
class MultiKVConnectorWorkerMetadata(KVConnectorWorkerMetadata):
    """Each child's worker metadata, in child order (None for a child that had none)."""

    children: tuple[KVConnectorWorkerMetadata | None, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, MultiKVConnectorWorkerMetadata) or len(other.children) != len(
            self.children
        ):
            raise TypeError(
                f"MultiKVConnectorWorkerMetadata of {len(self.children)} children cannot be "
                f"merged with {type(other).__name__}; every worker runs the same children"
            )
        return MultiKVConnectorWorkerMetadata(
            tuple(
                theirs if mine is None else mine if theirs is None else mine.aggregate(theirs)
                for mine, theirs in zip(self.children, other.children, strict=True)
            )
        )


def per_child_worker_meta(
    owner: str, worker_meta: Any, num_children: int
) -> tuple[KVConnectorWorkerMetadata | None, ...]:
    """The workers' merged report (or None) split into one entry per child, in child order.

    `owner` names the connector in the error about a report of another shape.
    """
    if worker_meta is None:
        return (None,) * num_children
    if (
        not isinstance(worker_meta, MultiKVConnectorWorkerMetadata)
        or len(worker_meta.children) != num_children
    ):
        raise TypeError(
            f"{owner} expected the MultiKVConnectorWorkerMetadata its "
            f"{num_children} children built, got {type(worker_meta).__name__}"
        )
    return worker_meta.children


@attrs.define
class MultiKVConnectorStats(KVConnectorStats):
    """Each child's stats by child name, each rebuilt by the child's own class.

    `data` maps a child's name to its `KVConnectorStats` (or the
    subclass its connector builds); merging merges child by child.
    """

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, theirs in other.data.items():
            child = theirs if isinstance(theirs, KVConnectorStats) else None
            if child is None:
                child = KVConnectorStats(data=dict(theirs))
            mine = self.data.get(name)
            self.data[name] = child if mine is None else mine.aggregate(child)
        return self

    def reduce(self) -> dict[str, Any]:
        return {name: stats.reduce() for name, stats in self.data.items()}

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.data.values())

    def reset(self) -> None:
        for stats in self.data.values():
            stats.reset()


def rebuild_child_stats(
    data: dict[str, Any] | None, child_class: Callable[[str], type[KVConnectorBase]]
) -> MultiKVConnectorStats:
    """Each child's counters (by child name) rebuilt by its class, as `child_class` names it.

    A child is named by its `kv_connector`, with `#<index>` after a
    repeated one; an unknown name raises `Connector '<name>' is not registered.`.
    A child whose class builds no stats (None, vLLM's default) is left out.
    """
    rebuilt: dict[str, Any] = {}
    for name, child_data in (data or {}).items():
        if isinstance(child_data, KVConnectorStats):
            rebuilt[name] = child_data
            continue
        child_cls = child_class(name.partition("#")[0])
        child_stats = child_cls.build_kv_connector_stats(data=child_data)
        if child_stats is not None:
            rebuilt[name] = child_stats
    return MultiKVConnectorStats(data=rebuilt)


@attrs.frozen
class MultiPromMetrics:
    """Each child's Prometheus metrics, by child name (a class's built once, as vLLM builds them).

    `observe` hands each child's counters, keyed by child name as
    `get_kv_connector_stats`
    keys them, to that child's metrics; a child whose class has none is left out.
    """

    by_child: dict[str, Any]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, child_data in transfer_stats_data.items():
            metrics = self.by_child.get(name)
            if metrics is not None:
                metrics.observe(child_data, engine_idx)
