"""What the single-server and the cluster Redis stores share: keys, settings, failure counts.

Both are a `kvwire.media.BlockStore` with the same settings, the
same server-side key names, the same checks on their arguments, and failure
counters reported under the same names, so that stats read alike whichever
one a profile names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvwire.common.redaction import shown
from kvwire.media.store.base import BlockStore
from kvwire.media.store.redis.settings import RedisStoreSettings


class RedisStoreBase(BlockStore):
    """A store of entries on Redis/Valkey, one key per entry: `key_prefix` + the store key."""

    medium = "redis"

    def __init__(self, settings: RedisStoreSettings) -> None:
        self._settings = settings
        # As warnings and the repr show the URL: a cluster's may name hundreds of seeds.
        self._shown_url = shown(settings.display_url)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(url={self._shown_url}, "
            f"key_prefix={self._settings.key_prefix!r})"
        )

    @property
    def settings(self) -> RedisStoreSettings:
        return self._settings

    def redis_key(self, key: str) -> str:
        """The server-side name of a store key."""
        return self._settings.key_prefix + key


def require_one_each(call: str, keys: Sequence[str], given: Sequence[Any], what: str) -> None:
    """A `ValueError` naming `call` unless there is one of `given` (`what`) per key."""
    if len(keys) != len(given):
        raise ValueError(f"{call}: {len(keys)} keys but {len(given)} {what}")


class FailureCounts:
    """Counts of what failed, cumulative and as increments since the last take; thread-safe.

    Increments are named as stats report them, `redis_<name>`, and only the
    nonzero ones are given.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)
        self._taken: dict[str, int] = {}

    def add(self, name: str, amount: int) -> None:
        with self._lock:
            self._values[name] += amount

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def take_increments(self) -> dict[str, int]:
        with self._lock:
            current = dict(self._values)
            increments = {
                f"redis_{name}": value - self._taken.get(name, 0)
                for name, value in current.items()
                if value != self._taken.get(name, 0)
            }
            self._taken = current
        return increments


def add_counts(into: dict[str, int], counts: Mapping[str, int]) -> None:
    """Add `counts` into `into`, name by name."""
    for name, value in counts.items():
        into[name] = into.get(name, 0) + value
