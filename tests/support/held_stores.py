"""Shared storage whose writes wait while a file exists: saves that outlive their requests.

``kv_connector_extra_config.hold_path`` names the file. While it exists,
every write waits (in the connector's background save threads, as a slow
medium would); a test creates it to hold saves back and removes it to let
them through, from any process, so this works with the worker in its own
process too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any

from kvwire.config.extra_config import ExtraConfigKey, str_key
from kvwire.connectors.offload import SharedStorageConnector
from kvwire.media.store.base import BlockStore
from kvwire.media.store.directory import DirectoryMedium

HOLD_LIMIT_S = 60.0
"""A test that never removes the file fails its writes after this, rather than hanging."""


class HeldStore(BlockStore):
    """``store``, with every ``put`` waiting while ``hold_path`` exists."""

    def __init__(self, store: BlockStore, hold_path: str) -> None:
        self._store = store
        self._hold_path = hold_path
        self.medium = store.medium

    def count_prefix(self, keys: Sequence[str]) -> int:
        return self._store.count_prefix(keys)

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        deadline = time.monotonic() + HOLD_LIMIT_S
        while os.path.exists(self._hold_path):
            if time.monotonic() > deadline:
                return [False] * len(keys)
            time.sleep(0.001)
        return self._store.put(keys, entries)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return self._store.get_into(keys, buffers)

    def read_each(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> Generator[tuple[int, int | None], None, None]:
        return self._store.read_each(keys, buffers)

    def discard(self, keys: Sequence[str]) -> None:
        self._store.discard(keys)

    def close(self) -> None:
        self._store.close()


class HeldDirectory(DirectoryMedium):
    """The directory medium over a :class:`HeldStore`; ``hold_path`` names the file."""

    @classmethod
    def extra_config_keys(cls) -> tuple[ExtraConfigKey, ...]:
        return (*super().extra_config_keys(), str_key("hold_path", None, required=True))

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        return HeldStore(super().create_store(options), options["hold_path"])


class HeldSharedStorageConnector(SharedStorageConnector):
    """The shared-storage connector over a :class:`HeldDirectory`.

    Named by module path, so a worker process resolves the medium too.
    """

    default_medium = f"{__name__}:{HeldDirectory.__name__}"
