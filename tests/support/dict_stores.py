"""A plug-in ``BlockStore`` that answers truthfully from one process-wide dict.

Both roles' stores share the dict on purpose: the scheduler's lookups see
the worker's saves, as they would through a real shared store. A test module
that needs entries of its own subclasses it with an ``entries`` dict of its
own; stores that misbehave subclass it and override one call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

from kvwire.media.store.base import BlockStore


class DictStore(BlockStore):
    """Entries in one process-wide dict, answered truthfully."""

    entries: ClassVar[dict[str, bytes]] = {}
    lock = threading.Lock()

    def count_prefix(self, keys: Sequence[str]) -> int:
        with self.lock:
            held = 0
            while held < len(keys) and keys[held] in self.entries:
                held += 1
            return held

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        with self.lock:
            for key, entry in zip(keys, entries, strict=True):
                self.entries[key] = bytes(entry)
        return [True] * len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sizes: list[int | None] = []
        with self.lock:
            for key, buffer in zip(keys, buffers, strict=True):
                entry = self.entries.get(key)
                if entry is None or len(entry) > len(buffer):
                    sizes.append(None)
                    continue
                buffer[: len(entry)] = entry
                sizes.append(len(entry))
        return sizes
