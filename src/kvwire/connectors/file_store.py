"""A :class:`BlockStore` in a directory that several engines share.

One file per entry, named by its key in sharded sub-folders
(``<root>/<layout fingerprint>/<2 hex digits>/<block hash>``). A writer
writes a hidden temporary file and renames it into place, so a reader (in any
process) sees a whole entry or none, even if the writer is killed mid-way.
Disk full, permission denied or a vanished directory fail the save with a
rate-limited warning and a counter, never an exception. An optional size cap
evicts the least recently used entries (reads refresh an entry's mtime).

Large entries can also be read by mapping their file (:meth:`DirectoryBlockStore.map_entry`):
the reader verifies the page cache's bytes in place and copies them once, into
the KV cache, instead of first reading them into a staging buffer. That is
safe because an entry file is never changed in place once renamed into view
(a process that truncated one would make a reader that has it mapped fault).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import TypeVar

from kvwire.connectors.counters import Counters
from kvwire.connectors.rate_limited import RateLimitedWarning
from kvwire.connectors.store import BlockStore

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")

_KEY_PART = re.compile(r"^[A-Za-z0-9_-]+$")
_TMP_SUFFIX = ".tmp"
# A temporary file this old belongs to a writer that died; eviction removes it.
_STALE_TMP_S = 600.0
# Eviction brings the directory down to this share of the cap, so that it
# does not run again on the very next write.
_EVICT_TO = 0.9
# Scans per eviction at most, when other writers keep adding during a scan.
_EVICTION_ROUNDS = 3

_ERROR_KINDS: dict[int, str] = {
    errno.ENOSPC: "disk_full",
    errno.EDQUOT: "disk_full",
    errno.EFBIG: "disk_full",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.ENOENT: "directory_missing",
}


class DirectoryBlockStore(BlockStore):
    """Entries as files under ``root``; safe for many threads and processes at once.

    ``fsync`` makes each entry durable before it becomes visible;
    ``max_bytes`` (0: no cap) bounds the bytes this store keeps under ``root``.
    """

    medium = "disk"

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False, max_bytes: int = 0):
        self.root = os.fspath(root)
        self._fsync = fsync
        self._max_bytes = max_bytes
        self._counters = Counters()
        self._warn = RateLimitedWarning(logger)
        self._size_lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._approx_bytes: int | None = None
        self._added_since_scan = 0
        # Removals run on I/O threads: evictions on whichever write crossed the cap.
        self._removed_lock = threading.Lock()
        self._removed_keys: list[str] = []

    def path_of(self, key: str) -> str:
        """The file that holds ``key``'s entry."""
        parts = key.split("/")
        if not parts or not all(_KEY_PART.match(part) for part in parts):
            raise ValueError(
                f"store key {key!r} is not a '/'-separated list of [A-Za-z0-9_-] names"
            )
        *folders, name = parts
        return os.path.join(self.root, *folders, name[:2], name)

    def take_counters(self) -> dict[str, float]:
        """Failure and eviction counts since the last call."""
        return self._counters.take()

    def take_removed_keys(self) -> list[str]:
        """Keys of the entries discarded or evicted since the last call, in that order."""
        with self._removed_lock:
            keys, self._removed_keys = self._removed_keys, []
        return keys

    def _removed(self, key: str) -> None:
        with self._removed_lock:
            self._removed_keys.append(key)

    # -------------------------------------------------------------- lookups

    def count_prefix(self, keys: Sequence[str]) -> int:
        count = 0
        for key in keys:
            try:
                if not os.path.isfile(self.path_of(key)):
                    break
            except (OSError, ValueError):
                break
            count += 1
        return count

    def _key_of_path(self, path: str) -> str:
        """The key whose entry is the file at ``path``: :meth:`path_of` undone (shard dropped)."""
        parts = os.path.relpath(path, self.root).split(os.sep)
        return "/".join([*parts[:-2], parts[-1]])

    # ---------------------------------------------------------------- reads

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        return [self._read(key, buffer) for key, buffer in zip(keys, buffers, strict=True)]

    def read_each(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> Generator[tuple[int, int | None], None, None]:
        # One file at a time, so the caller checks each entry while it is hot.
        for index, (key, buffer) in enumerate(zip(keys, buffers, strict=True)):
            yield index, self._read(key, buffer)

    def _read(self, key: str, buffer: memoryview) -> int | None:
        def read_into_buffer(fd: int, size: int) -> int | None:
            if size > len(buffer):
                return None
            read = 0
            while read < size:
                got = os.readv(fd, [buffer[read:size]])
                if got == 0:
                    break
                read += got
            return read

        return self._with_entry_file(key, read_into_buffer)

    def map_entry(self, key: str) -> mmap.mmap | None:
        """``key``'s file mapped read-only (private): None if missing, empty or unreadable.

        The caller closes the mapping. Nothing is copied until the caller reads it.
        """

        def map_file(fd: int, size: int) -> mmap.mmap | None:
            if size == 0:
                return None  # cannot be mapped; get_into reports it
            # Private: nothing written through the mapping ever reaches the file.
            return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)

        return self._with_entry_file(key, map_file)

    def _with_entry_file(
        self, key: str, use: Callable[[int, int], _Result | None]
    ) -> _Result | None:
        """``use(fd, size)`` on ``key``'s open file; None on a miss or a failure (counted)."""
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            self._fail("read", key, error)
            return None
        try:
            result = use(fd, os.fstat(fd).st_size)
            if result is not None and self._max_bytes:
                # Reads refresh the entry, so eviction is least-recently-used.
                os.utime(fd)
            return result
        except OSError as error:
            self._fail("read", key, error)
            return None
        finally:
            os.close(fd)

    # --------------------------------------------------------------- writes

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        results = [self._write(key, entry) for key, entry in zip(keys, entries, strict=True)]
        if self._max_bytes:
            self._account(sum(len(e) for e, ok in zip(entries, results, strict=True) if ok))
        return results

    def _write(self, key: str, entry: memoryview) -> bool:
        try:
            path = self.path_of(key)
        except ValueError as error:
            self._fail("write", key, error)
            return False
        folder, name = os.path.split(path)
        temporary = os.path.join(
            folder, f".{name}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
        )
        try:
            try:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except FileNotFoundError:
                # The shard folder is new; the root itself must exist (a vanished
                # root is an error, not something to recreate silently).
                if not os.path.isdir(self.root):
                    raise
                os.makedirs(folder, exist_ok=True)
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                written = 0
                while written < len(entry):
                    written += os.write(fd, entry[written:])
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, path)
            if self._fsync:
                self._fsync_folder(folder)
            return True
        except OSError as error:
            # Nothing half-written may remain: the temporary file goes.
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            self._fail("write", key, error)
            return False

    def _fsync_folder(self, folder: str) -> None:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fail(self, action: str, key: str, error: Exception) -> None:
        kind = "io_errors"
        if isinstance(error, OSError) and error.errno is not None:
            kind = _ERROR_KINDS.get(error.errno, "io_errors")
            if kind == "directory_missing" and os.path.isdir(self.root):
                kind = "io_errors"
        self._counters.add(f"{action}_{kind}")
        self._warn.warn(
            f"{action}:{kind}",
            "shared storage %s: %s of %s failed (%s): %s",
            self.root,
            action,
            key,
            kind,
            error,
        )

    def discard(self, keys: Sequence[str]) -> None:
        discarded = 0
        for key in keys:
            try:
                if _unlink_quietly(self.path_of(key)):
                    self._removed(key)
                    discarded += 1
            except ValueError:
                continue
        # Only files that were there: another reader may have discarded one first.
        self._counters.add("discarded_entries", discarded)

    # ------------------------------------------------------------- eviction

    def _over_cap(self) -> bool:
        with self._size_lock:
            return self._approx_bytes is None or self._approx_bytes > self._max_bytes

    def _account(self, added_bytes: int) -> None:
        with self._size_lock:
            if self._approx_bytes is not None:
                self._approx_bytes += added_bytes
            self._added_since_scan += added_bytes
        if not self._over_cap():
            return
        # One evicting thread at a time; the others wait (an I/O thread, never
        # the forward pass) and then find the directory under its cap.
        with self._evict_lock:
            for _ in range(_EVICTION_ROUNDS):
                if not self._over_cap():
                    return
                self.evict()

    def sweep_stale_temporary_files(self) -> int:
        """Remove the temporary files of writers that died mid-save; how many went."""
        removed = 0
        now = time.time()
        for folder, _, names in os.walk(self.root):
            for name in names:
                if not name.endswith(_TMP_SUFFIX):
                    continue
                path = os.path.join(folder, name)
                try:
                    stale = now - os.stat(path).st_mtime > _STALE_TMP_S
                except OSError:
                    continue
                if stale and _unlink_quietly(path):
                    removed += 1
        self._counters.add("stale_temporary_files_removed", removed)
        return removed

    def evict(self) -> int:
        """Bring the directory under its cap, oldest entries first; the bytes it holds.

        The scan also counts what other processes wrote, and removes the
        temporary files of writers that died.
        """
        entries: list[tuple[float, int, str]] = []
        now = time.time()
        with self._size_lock:
            self._added_since_scan = 0
        for folder, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                if name.endswith(_TMP_SUFFIX):
                    if now - info.st_mtime > _STALE_TMP_S:
                        _unlink_quietly(path)
                    continue
                entries.append((info.st_mtime, info.st_size, path))
        total = sum(size for _, size, _ in entries)
        if self._max_bytes and total > self._max_bytes:
            target = int(self._max_bytes * _EVICT_TO)
            entries.sort()
            for _, size, path in entries:
                if total <= target:
                    break
                if _unlink_quietly(path):
                    total -= size
                    self._counters.add_many({"evicted_blocks": 1, "evicted_bytes": size})
                    self._removed(self._key_of_path(path))
        with self._size_lock:
            # Writes that landed during the scan may be missing from it: count
            # them again (an overcount only brings the next eviction sooner).
            self._approx_bytes = total + self._added_since_scan
        return total


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True
