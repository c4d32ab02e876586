"""Where a store-backed connector keeps its encoded blocks.

A :class:`BlockStore` is a key-value store of whole entries (header plus
payload, see :mod:`kvwire.connectors.block_format`): a directory shared by
engines, a Redis/Valkey server. The connector owns the staging buffers and
the threads; a store only moves bytes between those buffers and its medium,
in batches, and reports failures per key instead of raising, so that one bad
entry or a dead server never reaches the engine as an exception.
"""

from __future__ import annotations

import abc
from collections.abc import Generator, Sequence


class BlockStore(abc.ABC):
    """A medium for encoded KV blocks, addressed by string keys.

    Implementations must be safe to call from several threads at once and
    from several processes sharing the medium.
    """

    #: Short name of the medium, used in stats and events ("disk", "redis").
    medium: str = "store"

    @abc.abstractmethod
    def count_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are present consecutively.

        An unreachable medium counts as 0 (a miss), never as an error.
        """

    @abc.abstractmethod
    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        """Store each entry under its key; True where it is now stored whole.

        A reader must see a whole entry or none, even if the writer dies
        mid-way.
        """

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        """Read each key's entry into its buffer; the bytes read, or None on a miss/failure.

        A buffer is at least one entry long; an entry longer than its buffer
        is a failure (None), never a partial read.
        """

    def read_each(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> Generator[tuple[int, int | None], None, None]:
        """Read entries as :meth:`get_into` does, yielding ``(index, size or None)`` as each lands.

        Every index is yielded once, in order. A caller verifies and copies
        each entry out while it is still in the CPU cache, and, with a server,
        while the server is still sending the next ones. A caller that stops
        early closes the iterator; the store then leaves nothing half-read
        behind. A call may cover many entries (a connector hands over a long
        run at once), so a store that talks to a server can ask for later
        entries while the caller works on earlier ones. This default reads
        everything first; stores that can do better override it.
        """
        yield from enumerate(self.get_into(keys, buffers))

    def discard(self, keys: Sequence[str]) -> None:
        """Remove entries a reader found corrupt, so they stop being hits; optional."""

    def take_removed_keys(self) -> list[str]:
        """Keys of the entries this store removed since the last call, then cleared.

        What it discarded and what it evicted itself (a size cap). Entries a
        medium drops on its own (a server's expiry or eviction) cannot be
        reported; the default, for a store that removes nothing, has none.
        """
        return []

    def close(self) -> None:
        """Release connections and file handles."""
