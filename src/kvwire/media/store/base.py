"""Where a store-backed connector keeps its encoded blocks.

A `kvwire.media.BlockStore` is a key-value store of whole entries (header plus
payload, see `kvwire.blocks.format`): a directory shared by
engines, a Redis/Valkey server. The connector owns the threads and the
memory; a store only moves bytes between that memory and its medium, in
batches, and reports failures per key instead of raising, so that one bad
entry or a dead server never reaches the engine as an exception.

The connector's data path
(`kvwire.media.BlockStore.read_into_ranges`,
`kvwire.media.BlockStore.write_ranges`) hands a store each entry as a
list of byte ranges: a small header buffer, then the block's ranges in the KV cache itself
(`kvwire.blocks.memory`). A store that can do scattered I/O (`preadv`/`pwritev`,
`recv_into`/`sendmsg`) overrides both and moves the bytes with no copy; any other store keeps the
defaults, which go through a per-thread scratch buffer and
`kvwire.media.BlockStore.read_each` /
`kvwire.media.BlockStore.put` (one copy).
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Generator, Iterator, Sequence
from typing import TypeGuard

from kvwire.common.redaction import kind_of
from kvwire.exceptions import JobAbandoned
from kvwire.exceptions import LateWriteError as LateWriteError
from kvwire.exceptions import StoreReplyError as StoreReplyError

# The default range I/O goes through scratch of about this size per thread
# (at least one entry): large enough that a store call moves a few entries,
# small enough to stay in the CPU's cache between the copy and the I/O.
SCRATCH_BYTES = 4 * 1024 * 1024

# How long a waiter that gave up on a load waits for a read already in a
# syscall: a local disk answers within this even when slow; one that does
# not is stuck, and the engine must stop rather than let it land later.
LATE_WRITE_GRACE_S = 10.0


class CacheWrites:
    """The gate on a transfer's access to its cache ranges.

    A load: the store wraps each call that writes into the caller's ranges
    (one `preadv`, one `recv_into`, one copy) in `kvwire.media.CacheWrites.writing`; once
    the connector has given up on the load (`kvwire.media.CacheWrites.close`),
    `kvwire.media.CacheWrites.writing` raises `kvwire.media.JobAbandoned`
    instead of letting the write start, and the store lets that exception end its generator.
    `kvwire.media.CacheWrites.close` waits for a write already under way to return.

    A save (its `commit_gate`, see
    `kvwire.media.BlockStore.write_ranges`): the connector closes it when
    the save's blocks may change under it (given out again, or the save given up on); an entry then
    commits only if all its bytes had left the ranges while the gate was still open
    (`kvwire.media.CacheWrites.is_open`), so no entry is ever made from bytes being
    overwritten.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._closed = False
        self._in_flight = 0

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around one write into the ranges; raises `JobAbandoned` once the load is given up."""
        with self._changed:
            if self._closed:
                raise JobAbandoned
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def is_open(self) -> bool:
        """Whether the gate is open, asked under its lock: a
        `kvwire.media.CacheWrites.close` returns after or before.

        A save asks it once all of an entry's bytes have left the ranges
        (handed to the kernel, or copied): open, the bytes were read before
        the ranges could change, and the entry may commit.
        """
        with self._changed:
            return not self._closed

    def close(self, grace_s: float) -> None:
        """Let no write start; wait `grace_s` for one under way, or
        `kvwire.media.LateWriteError`."""
        with self._changed:
            self._closed = True
            if self._changed.wait_for(lambda: self._in_flight == 0, max(0.0, grace_s)):
                return
        raise LateWriteError(
            f"a load given up on at its deadline is still writing into the KV cache "
            f"{grace_s:g} s later (a read blocked in the medium); stopping rather than "
            "risk that it lands in blocks the engine has taken back"
        )


def checked_write_results(reply: object, count: int, call: str) -> list[bool]:
    """`reply` if it holds `count` booleans, one per key of `call`; else StoreReplyError."""
    if isinstance(reply, list) and len(reply) == count and all(type(ok) is bool for ok in reply):
        return reply
    if isinstance(reply, list):
        what = f"a list of {len(reply)} results"
        if len(reply) == count:
            what += " that are not all true or false"
    else:
        what = kind_of(reply)
    raise StoreReplyError(
        f"{call} answered {what} for {count} entries; expected one true or false per entry"
    )


class _Scratch(threading.local):
    """One reusable buffer per thread, for the default range I/O."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def views(self, sizes: Sequence[int]) -> list[memoryview]:
        """Consecutive views of `sizes` bytes each, in this thread's buffer (grown if needed)."""
        total = sum(sizes)
        if len(self.buffer) < total:
            self.buffer = bytearray(total)
        whole = memoryview(self.buffer)
        views, offset = [], 0
        for size in sizes:
            views.append(whole[offset : offset + size])
            offset += size
        return views


_scratch = _Scratch()


def _scratch_chunks(sizes: Sequence[int]) -> list[range]:
    """Consecutive index ranges of entries whose sizes add up to about `SCRATCH_BYTES`."""
    chunks: list[range] = []
    start = total = 0
    for index, size in enumerate(sizes):
        if index > start and total + size > SCRATCH_BYTES:
            chunks.append(range(start, index))
            start, total = index, 0
        total += size
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


class BlockStore(abc.ABC):
    """A medium for encoded KV blocks, addressed by string keys.

    Implementations must be safe to call from several threads at once and
    from several processes sharing the medium.
    """

    #: Short name of the medium, used in stats and events ("disk", "redis").
    medium: str = "store"

    @abc.abstractmethod
    def count_prefix(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present consecutively.

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
        """Read entries as `kvwire.media.BlockStore.get_into` does, yielding
        `(index, size or None)` as each lands.

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

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        """Read each key's entry into its ranges, yielding `(index, size or None)` as each lands.

        `ranges_per_key[i]` is key `i`'s entry split into writable byte
        ranges, in order: the entry's first `len(ranges[0])` bytes go into
        `ranges[0]`, the next into `ranges[1]`, and so on (the connector
        passes a header buffer, then the block's ranges in the KV cache). The
        size yielded is the entry's length; an entry longer than its ranges
        together is a failure (None) and writes nothing; a shorter one fills
        what it covers and reports its length (the caller's check rejects it).

        As `kvwire.media.BlockStore.read_each`: every index is yielded once, in order;
        the caller checks each entry as it lands; a caller that stops early closes the iterator. The
        store may write into key `i`'s ranges at any time between the call and yielding `i`, never
        after. Every write into the ranges goes through `writes.writing()` (when `writes` is given),
        one call (syscall, copy) at a time, and a `JobAbandoned` it raises ends the generator (let
        it propagate): that is how a load given up on stops writing into the cache. This default
        reads a few MiB of entries at a time into a per-thread scratch buffer with
        `kvwire.media.BlockStore.read_each`, then copies each into its ranges; stores
        that can read into scattered memory override it.
        """
        sizes = [sum(len(r) for r in ranges) for ranges in ranges_per_key]
        for chunk in _scratch_chunks(sizes):
            buffers = _scratch.views([sizes[i] for i in chunk])
            chunk_keys = [keys[i] for i in chunk]
            with contextlib.closing(self.read_each(chunk_keys, buffers)) as landed:
                for position, size in landed:
                    if not (_is_count(position) and 0 <= position < len(chunk)):
                        # No entry of this call: passed on as no index, for the caller to refuse.
                        yield -1, size
                        continue
                    index = chunk[position]
                    if _is_count(size):
                        with writes.writing() if writes is not None else contextlib.nullcontext():
                            _copy_into(buffers[position][:size], ranges_per_key[index])
                    yield index, size

    def write_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        commit_gate: CacheWrites | None = None,
    ) -> list[bool]:
        """Store each key's entry, given as its ranges in order; True where it is now stored whole.

        As `kvwire.media.BlockStore.put`, with each entry the concatenation of its ranges (a
        header, then the block's ranges in the KV cache). The ranges are only
        read, and not after the call returns.

        With `commit_gate`, an entry is committed (made visible to readers)
        only if all its bytes left the ranges while the gate was open: the
        connector closes it when the blocks may change under the save, and an
        entry made of bytes being overwritten would be torn. A store that
        writes from the ranges in place checks
        `kvwire.media.CacheWrites.is_open` once the
        medium (the kernel) holds all of an entry's bytes, just before it
        commits (a rename, the end of a command), and otherwise drops the entry
        (False); once the gate is closed it starts no entry. This default
        copies a few MiB of entries at a time into a per-thread scratch buffer,
        each copy under `commit_gate.writing()`, and calls
        `kvwire.media.BlockStore.put` on the copies; stores that can
        write scattered memory override it.
        """
        sizes = [sum(len(r) for r in ranges) for ranges in ranges_per_key]
        results = [False] * len(keys)
        for chunk in _scratch_chunks(sizes):
            entries = _scratch.views([sizes[i] for i in chunk])
            try:
                with contextlib.nullcontext() if commit_gate is None else commit_gate.writing():
                    for entry, index in zip(entries, chunk, strict=True):
                        offset = 0
                        for part in ranges_per_key[index]:
                            entry[offset : offset + len(part)] = part
                            offset += len(part)
            except JobAbandoned:
                break  # the rest is never copied, never stored
            # The copies stay whole whatever happens to the ranges now.
            reply = self.put([keys[i] for i in chunk], entries)
            results[chunk.start : chunk.stop] = checked_write_results(
                reply, len(chunk), f"{type(self).__name__}.put"
            )
        return results

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


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _copy_into(entry: memoryview, ranges: Sequence[memoryview]) -> None:
    """Copy `entry` into `ranges` in order, as far as it reaches."""
    offset = 0
    for part in ranges:
        if offset >= len(entry):
            return
        piece = entry[offset : offset + len(part)]
        part[: len(piece)] = piece
        offset += len(piece)
