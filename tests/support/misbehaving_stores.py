"""Plug-in stores that fail mid-run as a third-party store can, each named after how.

Each keeps entries in one process-wide dict like an honest store, and
misbehaves in one call: the engine must carry on with the outputs it would
have without a connector, warn in one line naming the store's call, and
never show the secret the store's message quotes.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvwire.media.store.medium import StoreMedium
from tests.support.dict_stores import DictStore

SECRET = "hunter2-secret"
LEAKY_MESSAGE = f"lost redis://u:{SECRET}@h (password={SECRET})"


class RaisingStore(DictStore):
    """Its ``put`` and ``get_into`` raise, quoting a URL with its password."""

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        raise ConnectionError(LEAKY_MESSAGE)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        raise ConnectionError(LEAKY_MESSAGE)


class ExitingStore(DictStore):
    """Its ``put`` and ``get_into`` call ``sys.exit()``, as a careless client library might."""

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        sys.exit(LEAKY_MESSAGE)

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        sys.exit(LEAKY_MESSAGE)


class ShortReplyStore(DictStore):
    """Stores every entry, but its ``put`` answers one result fewer than the keys it got."""

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        return super().put(keys, entries)[:-1]


class RaisingRemovedKeysStore(DictStore):
    """Its ``take_removed_keys``, asked after every save, raises."""

    def take_removed_keys(self) -> list[str]:
        raise ConnectionError(LEAKY_MESSAGE)


class RaisingDiscardStore(DictStore):
    """Its ``discard``, asked to drop the entries a reader found corrupt, raises."""

    def discard(self, keys: Sequence[str]) -> None:
        raise ConnectionError(LEAKY_MESSAGE)


class DictMedium(StoreMedium[DictStore]):
    """A third-party medium over whichever store class ``store_class`` names."""

    event_medium = "plugin-store"
    store_class: ClassVar[type[DictStore]] = DictStore

    def create_store(self, options: Mapping[str, Any]) -> DictStore:
        return self.store_class()


class RaisingMedium(DictMedium):
    store_class = RaisingStore


class ExitingMedium(DictMedium):
    store_class = ExitingStore


class ShortReplyMedium(DictMedium):
    store_class = ShortReplyStore


class RaisingRemovedKeysMedium(DictMedium):
    store_class = RaisingRemovedKeysStore


class RaisingDiscardMedium(DictMedium):
    store_class = RaisingDiscardStore
