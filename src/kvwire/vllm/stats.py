"""kvwire's counters as vLLM's `KVConnectorStats`, and as Prometheus counters.

Only the worker half reports stats (kvwire's scheduler half sends its lookup
counts to the workers in the step's metadata), so nothing is counted twice.
vLLM sums its ranks' stats (`aggregate`): with tensor or pipeline
parallelism, what a rank moved counts on that rank (`blocks_loaded` is
the entries every rank loaded, one per rank's share of a block), and the
lookup counts come from rank 0 alone, once per block looked up.
A MultiConnector's children nest under their connector's name; vLLM's log
line and `/metrics` see them flattened as `<child>.<counter>`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvwire.interface.types import KVConnectorStats as KVWireCounters

METRIC_PREFIX = "vllm:kvwire_"


@dataclasses.dataclass
class KVWireStats(KVConnectorStats):
    """kvwire's counters since the last report; merged by adding, key by key."""

    def reset(self) -> None:
        empty: dict[str, Any] = {}
        self.data = empty

    def aggregate(self, other: KVConnectorStats) -> KVWireStats:
        merged = KVWireCounters(data=dict(self.data)).aggregate(KVWireCounters(data=other.data))
        self.data = merged.data
        return self

    def reduce(self) -> dict[str, int | float]:
        return flatten_counters(self.data)

    def is_empty(self) -> bool:
        return not self.data


def flatten_counters(data: Mapping[str, Any], prefix: str = "") -> dict[str, int | float]:
    """Nested counters as one level: `{"cpu": {"blocks": 2}}` -> `{"cpu.blocks": 2}`."""
    flat: dict[str, int | float] = {}
    for name, value in data.items():
        if isinstance(value, Mapping):
            flat.update(flatten_counters(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def metric_name(counter: str) -> str:
    """The Prometheus name of a kvwire counter: `vllm:kvwire_<counter>` in [a-z0-9_]."""
    return METRIC_PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", counter)


class KVWirePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per kvwire counter, created when it is first reported.

    kvwire's counters are named by the connector that reports them (a
    composite adds its children's), so they are not known up front.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for counter, value in flatten_counters(transfer_stats_data).items():
            if value <= 0:
                continue
            metric = self._counters.get(counter)
            if metric is None:
                metric = self._counter_cls(
                    name=metric_name(counter),
                    documentation=f"kvwire connector counter {counter}",
                    labelnames=self._labelnames,
                )
                self._counters[counter] = metric
            metric.labels(*labels).inc(value)
