"""Thread-safe counters that a connector's worker half reports as its stats."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvwire.interface.types import KVConnectorStats


class Counters:
    """Named numbers, added to from any thread, taken (and reset) by the reporter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def add_many(self, amounts: Mapping[str, float]) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] = self._values.get(name, 0) + amount

    def take(self) -> dict[str, float]:
        """The counts since the last call, then zero."""
        with self._lock:
            values, self._values = self._values, {}
        return values

    def take_stats(self) -> KVConnectorStats | None:
        """The nonzero counts since the last call as stats (None if none), then zero."""
        values = {name: value for name, value in self.take().items() if value}
        return KVConnectorStats(data=values) if values else None
