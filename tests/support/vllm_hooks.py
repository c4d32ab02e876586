"""Container hooks the tests name in ``kvwire_container_hook``: they override providers of the
container KVWireConnector builds inside vLLM, as a deployment would."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from dependency_injector import containers, providers

from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.interface.types import BlockHash, KVCacheEvent
from kvwire.media.base import MediumIndex
from kvwire.media.cpu_pool import CPUPoolMedium
from kvwire.media.store.base import BlockStore
from kvwire.media.store.directory import DirectoryMedium


class NeverHitIndex(MediumIndex):
    """``index``, except that it never reports a block as held: every lookup misses."""

    def __init__(self, index: MediumIndex) -> None:
        self._index = index

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        return 0

    def prepare_load(self, group: int, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        return self._index.prepare_load(group, block_hashes)

    def complete_load(
        self, group: int, block_hashes: Sequence[BlockHash], corrupt: Sequence[BlockHash]
    ) -> None:
        self._index.complete_load(group, block_hashes, corrupt)

    def prepare_save(
        self, group: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[BlockHash, int | None]]:
        return self._index.prepare_save(group, block_hashes)

    def complete_save(
        self, group: int, block_hashes: Sequence[BlockHash], *, success: bool
    ) -> None:
        self._index.complete_save(group, block_hashes, success=success)

    def take_events(self) -> list[KVCacheEvent]:
        return self._index.take_events()

    def take_counters(self) -> Mapping[str, int]:
        return self._index.take_counters()

    def reset(self) -> bool | None:
        return self._index.reset()

    def close(self) -> None:
        self._index.close()


class NeverHitPool(CPUPoolMedium):
    """The CPU pool, its blocks stored as ever, but never found by a lookup."""

    def build_index(self) -> MediumIndex:
        return NeverHitIndex(super().build_index())


class NeverHitCPUOffload(CPUOffloadConnector):
    """CPU offload whose pool never reports a block as held: every lookup misses.

    The medium is named by module path, so the scheduler's process resolves it too.
    """

    default_medium = f"{__name__}:{NeverHitPool.__name__}"


def never_hit(container: containers.Container) -> None:
    container.connector_class.override(providers.Object(NeverHitCPUOffload))


READS_ANSWER = threading.Event()
"""While clear, every read of :class:`HeldReadsSharedStorage`'s store waits for it (bounded)."""
READS_ANSWER.set()

HELD_READ_LIMIT_S = 60.0
"""No read is held longer than this, whatever a failed test left behind."""


class HeldReadsStore(BlockStore):
    """``store``, whose reads wait for :data:`READS_ANSWER`: a load stays in flight meanwhile."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store
        self.medium = store.medium

    def count_prefix(self, keys: Sequence[str]) -> int:
        return self._store.count_prefix(keys)

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        return self._store.put(keys, entries)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        READS_ANSWER.wait(HELD_READ_LIMIT_S)
        return self._store.get_into(keys, buffers)

    def discard(self, keys: Sequence[str]) -> None:
        self._store.discard(keys)

    def take_removed_keys(self) -> list[str]:
        return self._store.take_removed_keys()

    def close(self) -> None:
        self._store.close()


class HeldReadsDirectory(DirectoryMedium):
    """The directory medium over a :class:`HeldReadsStore`."""

    def create_store(self, options: Mapping[str, Any]) -> BlockStore:
        return HeldReadsStore(super().create_store(options))


class HeldReadsSharedStorage(SharedStorageConnector):
    """Shared storage whose loads stay in flight until a test sets :data:`READS_ANSWER`."""

    default_medium = f"{__name__}:{HeldReadsDirectory.__name__}"


def held_reads(container: containers.Container) -> None:
    container.connector_class.override(providers.Object(HeldReadsSharedStorage))
