"""A `kvwire.media.BlockStore` in a directory that several engines share.

One file per entry, named by its key in sharded sub-folders
(`<root>/<layout fingerprint>/<2 hex digits>/<block hash>`, see
`kvwire.media.store.directory._layout`). A writer writes a hidden
temporary file (created exclusively, never through a link) and renames it
into place, so a reader (in any process) sees a whole entry or none, even if
the writer is killed mid-way. Disk full, permission denied or a vanished
directory fail the save with a rate-limited warning and a counter, never an
exception. An optional size cap evicts the least recently used entries
(reads refresh an entry's mtime). Eviction and the sweep of dead writers'
temporary files remove only files that are provably kvwire's: the root may
hold the user's own files.

Entries and folders get the modes of `kvwire.media.store.directory._modes`
(owner-only by default). A reader opens an entry without following a link
and without blocking (a FIFO put in an entry's place must not hang a load),
and reads only a regular file no larger than an entry; anything else is a
bad entry: warned about, counted, a failed load.

The connector's data path reads an entry straight into the KV cache's block
ranges (`DirectoryBlockStore.read_into_ranges`: `preadv` of the header
buffer and the ranges, a few MiB per call) and writes one straight from them
(`DirectoryBlockStore.write_ranges`: `pwritev` into the temporary
file): no staging copy on either side. The file rules above hold for both.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import TypeVar

from kvwire.common.redaction import shown
from kvwire.interface.counters import Counters
from kvwire.media.rate_limited import RateLimitedWarning
from kvwire.media.store.base import BlockStore, CacheWrites
from kvwire.media.store.directory._layout import (
    FolderIdentity,
    ScannedFile,
    Shard,
    ShardContents,
    entry_location,
    entry_path,
    open_shard,
    remove_empty_layout,
    remove_empty_shard,
    scan_shard,
    shards,
    temporary_name,
)
from kvwire.media.store.directory._modes import PRIVATE, FileModes, make_folder, process_umask

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")

# Never through a link, and never blocking: a FIFO in an entry's place would
# otherwise hang the open until some process writes to it.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
# A new file or nothing: never another writer's temporary file, never a link's target.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
# One preadv/pwritev moves at most this much: a load given up on stops
# between calls, so this bounds what lands after the check (and how long its
# waiter waits for the call in flight); larger calls gain nothing measurable.
MAX_IO_BYTES = 4 * 1024 * 1024
# Linux refuses more buffers than this in one preadv/pwritev.
_MAX_IO_PARTS = 1024
# Creating a temporary file retries this often when its shard folder is missing
# (new, or removed as empty by an eviction in another process meanwhile).
_CREATE_ATTEMPTS = 3
# A temporary file this old belongs to a writer that died; eviction removes it.
_STALE_TMP_S = 600.0
# An empty shard folder unchanged for this long goes; a younger one may be a
# writer's, just created, that it is about to write into.
_EMPTY_FOLDER_IDLE_S = 600.0
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
    """Entries as files under `root`; safe for many threads and processes at once.

    `entry_bytes` is the size of an entry: a larger file is a bad entry
    and is never read (a smaller one reaches the reader, whose check reports
    it). `fsync` makes each entry durable before it becomes visible;
    `max_bytes` (0: no cap) bounds the bytes of kvwire's entries under
    `root`; `modes` are the permissions of the files and folders it creates.
    `drop_from_page_cache`: each entry is written to the disk and its pages
    dropped from the page cache once written, and again once read.
    """

    medium = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        entry_bytes: int,
        fsync: bool = False,
        max_bytes: int = 0,
        modes: FileModes = PRIVATE,
        drop_from_page_cache: bool = False,
    ):
        self.root = os.fspath(root)
        # As errors and warnings show it: a root may be as long as the system allows.
        self._shown_root = shown(self.root)
        if "\0" in self.root:
            raise ValueError(
                f"directory store root {self._shown_root} contains a NUL byte; "
                "expected a directory path without one"
            )
        self._entry_bytes = entry_bytes
        self._fsync = fsync
        self._max_bytes = max_bytes
        self._modes = modes
        self._drop_from_page_cache = drop_from_page_cache
        # Exact modes whatever the umask, at no cost per write when the umask
        # leaves them as they are (the usual case for owner-only files).
        self._chmod_entries = modes.entry & ~process_umask() != modes.entry
        # Temporary names are unique across the hosts that share the directory
        # (pids repeat between hosts); O_EXCL turns the unlikely clash into a failed save.
        self._serials = itertools.count(secrets.randbits(48))
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
        """The file that holds `key`'s entry (`ValueError` for a key of another form)."""
        return entry_path(self.root, key)

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
                # Not following links: a link in an entry's place is no entry.
                if not stat.S_ISREG(os.lstat(self.path_of(key)).st_mode):
                    break
            except (OSError, ValueError):
                break
            count += 1
        return count

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
        return self._read_ranges(key, (buffer,), None)

    def read_into_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        writes: CacheWrites | None = None,
    ) -> Generator[tuple[int, int | None], None, None]:
        """Read each entry file straight into its ranges with `preadv`, a few MiB per call.

        One file at a time, so the caller checks each entry while it is hot;
        each call goes through `writes` (see
        `kvwire.media.BlockStore.read_into_ranges`).
        """
        for index, (key, ranges) in enumerate(zip(keys, ranges_per_key, strict=True)):
            yield index, self._read_ranges(key, ranges, writes)

    def _read_ranges(
        self, key: str, ranges: Sequence[memoryview], writes: CacheWrites | None
    ) -> int | None:
        def read_into_ranges(fd: int, size: int) -> int | None:
            room = sum(len(part) for part in ranges)
            if size > room:
                raise ValueError(f"{room} bytes cannot hold an entry of {size}")
            read = 0
            for batch in _io_batches(ranges, size):
                while batch:
                    if writes is None:
                        got = os.preadv(fd, batch, read)
                    else:
                        with writes.writing():
                            got = os.preadv(fd, batch, read)
                    if got == 0:
                        return read  # the file ended early: the caller's check rejects it
                    read += got
                    batch = _after(batch, got)
            return read

        return self._with_entry_file(key, read_into_ranges)

    def _with_entry_file(
        self, key: str, use: Callable[[int, int], _Result | None]
    ) -> _Result | None:
        """`use(fd, size)` on `key`'s open entry file; None on a miss or a failure (counted).

        `size` is at most `entry_bytes`: a larger file is a bad entry, and
        so is a link or anything but a regular file.
        """
        try:
            path = self.path_of(key)
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno == errno.ELOOP:
                # Left in place: what it points to is not kvwire's, and a link
                # is never a hit (count_prefix), so it costs no further load.
                self._bad_entry(key, "is a symbolic link, which kvwire never follows")
            else:
                self._fail("read", key, error)
            return None
        except ValueError as error:
            self._fail("read", key, error)
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self._bad_entry(key, "is not a regular file")
                return None
            if info.st_size > self._entry_bytes:
                self._bad_entry(
                    key, f"is {info.st_size} bytes, longer than an entry ({self._entry_bytes})"
                )
                # It would be a hit, and a failed load, for every later request.
                self._discard_opened(key, info)
                return None
            result = use(fd, info.st_size)
            if self._drop_from_page_cache:
                _drop_pages(fd)
            if result is not None and self._max_bytes:
                # Reads refresh the entry, so eviction is least-recently-used.
                # Best effort: a reader that may not (a read-only mount,
                # another user's entry) still loads it.
                with contextlib.suppress(OSError):
                    os.utime(fd)
            return result
        except (OSError, ValueError) as error:
            self._fail("read", key, error)
            return None
        finally:
            os.close(fd)

    def _bad_entry(self, key: str, what: str) -> None:
        self._counters.add("corrupt_entries")
        self._warn.warn(
            "bad_entry", "shared storage %s: not loading %s: it %s", self._shown_root, key, what
        )

    def _discard_opened(self, key: str, opened: os.stat_result) -> None:
        """Remove the entry file that was opened as `opened`, unless another has replaced it."""
        shard, name = entry_location(self.root, key)
        with open_shard(self.root, shard) as folder:
            if folder is None:
                return
            try:
                now = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
            except OSError:
                return
            same = (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)
            if same and _unlink_quietly(name, folder.fd):
                self._removed(key)
                self._counters.add("discarded_entries")

    # --------------------------------------------------------------- writes

    def put(self, keys: Sequence[str], entries: Sequence[memoryview]) -> list[bool]:
        return self.write_ranges(keys, [(entry,) for entry in entries])

    def write_ranges(
        self,
        keys: Sequence[str],
        ranges_per_key: Sequence[Sequence[memoryview]],
        commit_gate: CacheWrites | None = None,
    ) -> list[bool]:
        """Write each entry straight from its ranges with `pwritev` into a new temporary file.

        The file is renamed into place only if `commit_gate` is still open once
        every byte was written (see
        `kvwire.media.BlockStore.write_ranges`);
        otherwise it is removed, and the entry already there stays.
        """
        results = [False] * len(keys)
        for index, (key, ranges) in enumerate(zip(keys, ranges_per_key, strict=True)):
            if commit_gate is not None and commit_gate.closed:
                break
            results[index] = self._write(key, ranges, commit_gate)
        if self._max_bytes:
            self._account(
                sum(
                    sum(len(part) for part in ranges)
                    for ranges, ok in zip(ranges_per_key, results, strict=True)
                    if ok
                )
            )
        return results

    def _write(
        self, key: str, ranges: Sequence[memoryview], commit_gate: CacheWrites | None = None
    ) -> bool:
        try:
            path = self.path_of(key)
        except ValueError as error:
            self._fail("write", key, error)
            return False
        folder, name = os.path.split(path)
        temporary = os.path.join(folder, temporary_name(name, os.getpid(), next(self._serials)))
        created = False
        try:
            fd = self._create_temporary(temporary, folder)
            created = True
            try:
                if self._chmod_entries:
                    os.fchmod(fd, self._modes.entry)
                written = 0
                for batch in _io_batches(ranges, sum(len(part) for part in ranges)):
                    while batch:
                        done = os.pwritev(fd, batch, written)
                        if done == 0:
                            # Nothing moved and no error: retrying would spin
                            # for ever; the temporary file goes (below).
                            raise OSError(errno.EIO, "pwritev wrote nothing")
                        written += done
                        batch = _after(batch, done)
                if self._fsync:
                    os.fsync(fd)
                if self._drop_from_page_cache:
                    # Dirty pages cannot be dropped: written out first.
                    if not self._fsync:
                        os.fdatasync(fd)
                    _drop_pages(fd)
            finally:
                os.close(fd)
            if commit_gate is not None and not commit_gate.is_open():
                # The blocks may have changed while pwritev read them: this
                # file may be torn, and must not replace a good entry.
                os.unlink(temporary)
                return False
            os.replace(temporary, path)
            if self._fsync:
                self._fsync_folder(folder)
            return True
        except OSError as error:
            # Nothing half-written may remain: the temporary file goes (only
            # one this write created: a clash must not remove another's).
            if created:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            self._fail("write", key, error)
            return False

    def _create_temporary(self, temporary: str, folder: str) -> int:
        for _ in range(_CREATE_ATTEMPTS - 1):
            try:
                return os.open(temporary, _CREATE_FLAGS, self._modes.entry)
            except FileNotFoundError:
                # The root itself must exist: a vanished root is an error, not
                # something to recreate silently.
                if not os.path.isdir(self.root):
                    raise
                self._make_folders(folder)
        return os.open(temporary, _CREATE_FLAGS, self._modes.entry)

    def _make_folders(self, shard_folder: str) -> None:
        """Create the layout and shard folders of `shard_folder` that are missing.

        A folder that another process removes meanwhile (a reset) is left to
        the next attempt.
        """
        for folder in (os.path.dirname(shard_folder), shard_folder):
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                make_folder(folder, self._modes)

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
            self._shown_root,
            action,
            key,
            kind,
            _error_text(error),
        )

    def discard(self, keys: Sequence[str]) -> None:
        discarded = 0
        for key in keys:
            try:
                shard, name = entry_location(self.root, key)
            except ValueError:
                continue
            with open_shard(self.root, shard) as folder:
                if folder is not None and _unlink_regular_file(name, folder.fd):
                    self._removed(key)
                    discarded += 1
        # Only files that were there: another reader may have discarded one first.
        self._counters.add("discarded_entries", discarded)

    def remove_layout(self, layout: str) -> bool:
        """Remove every entry of `layout`, and its folders once empty; whether none is left.

        Files that are not kvwire's stay, and so do the folders that hold them.
        """
        left = 0
        for shard in shards(self.root, layout):
            contents = scan_shard(self.root, shard)
            removed = self._remove_scanned(shard, contents.folder, contents.entries)
            left += len(contents.entries) - len(removed)
            if _file_count(contents) == len(removed):
                remove_empty_shard(self.root, shard)
        remove_empty_layout(self.root, layout)
        return left == 0

    def _remove_scanned(
        self, shard: Shard, folder: FolderIdentity | None, files: Sequence[ScannedFile]
    ) -> set[str]:
        """Remove `files` from the shard folder scanned as `folder`; the names removed.

        Nothing when the folder is no longer the one scanned: its names may then
        be anyone's files.
        """
        if not files:
            return set()
        with open_shard(self.root, shard, folder) as opened:
            if opened is None:
                return set()
            return {file.name for file in files if _unlink_quietly(file.name, opened.fd)}

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
        """Remove the temporary files of writers that died mid-save; how many went.

        Shard folders that have stayed empty for a while go too.
        """
        removed = 0
        now = time.time()
        for shard in shards(self.root):
            contents = scan_shard(self.root, shard)
            swept = self._remove_stale_temporary_files(shard, contents, now)
            removed += swept
            if _file_count(contents) == swept:
                remove_empty_shard(self.root, shard, unchanged_since=now - _EMPTY_FOLDER_IDLE_S)
        self._counters.add("stale_temporary_files_removed", removed)
        return removed

    def evict(self) -> int:
        """Bring the directory under its cap, oldest entries first; the bytes it holds.

        The scan also counts what other processes wrote, and removes the
        temporary files of writers that died and the shard folders that have
        stayed empty for a while (one emptied now goes at a later scan).
        """
        entries: list[tuple[ScannedFile, Shard]] = []
        folders: dict[Shard, FolderIdentity | None] = {}
        files_left: dict[Shard, int] = {}
        now = time.time()
        with self._size_lock:
            self._added_since_scan = 0
        for shard in shards(self.root):
            contents = scan_shard(self.root, shard)
            folders[shard] = contents.folder
            files_left[shard] = _file_count(contents)
            files_left[shard] -= self._remove_stale_temporary_files(shard, contents, now)
            entries.extend((entry, shard) for entry in contents.entries)
        total = sum(entry.size for entry, _ in entries)
        if self._max_bytes and total > self._max_bytes:
            target = int(self._max_bytes * _EVICT_TO)
            entries.sort(key=lambda found: (found[0].mtime, found[1].path, found[0].name))
            # The oldest until the target, removed a shard folder at a time
            # (each opened once, and checked to be the folder scanned).
            victims: dict[Shard, list[ScannedFile]] = {}
            for entry, shard in entries:
                if total <= target:
                    break
                victims.setdefault(shard, []).append(entry)
                total -= entry.size
            for shard, files in victims.items():
                removed = self._remove_scanned(shard, folders[shard], files)
                for entry in files:
                    if entry.name not in removed:
                        total += entry.size  # still there: it still counts
                        continue
                    files_left[shard] -= 1
                    self._counters.add_many({"evicted_blocks": 1, "evicted_bytes": entry.size})
                    self._removed(shard.key_of(entry.name))
        for shard, count in files_left.items():
            if count == 0:
                remove_empty_shard(self.root, shard, unchanged_since=now - _EMPTY_FOLDER_IDLE_S)
        with self._size_lock:
            # Writes that landed during the scan may be missing from it: count
            # them again (an overcount only brings the next eviction sooner).
            self._approx_bytes = total + self._added_since_scan
        return total

    def _remove_stale_temporary_files(
        self, shard: Shard, contents: ShardContents, now: float
    ) -> int:
        stale = [file for file in contents.temporary_files if now - file.mtime > _STALE_TMP_S]
        return len(self._remove_scanned(shard, contents.folder, stale))


def _drop_pages(fd: int) -> None:
    """Ask the system to drop `fd`'s clean pages from the page cache (advice, never an error)."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _io_batches(ranges: Sequence[memoryview], size: int) -> list[list[memoryview]]:
    """The first `size` bytes of `ranges`: lists of views, one `preadv`/`pwritev` each.

    Each list holds at most `MAX_IO_BYTES` and at most the system's
    limit of buffers per call. A range goes in as it is, sliced only where it
    crosses a call's byte limit or the end of `size`: a block has hundreds
    of ranges, and slicing each costs more than the syscalls.
    """
    batches: list[list[memoryview]] = []
    batch: list[memoryview] = []
    room = MAX_IO_BYTES
    left = size
    for part in ranges:
        if left <= 0:
            break
        length = len(part)
        if length > left:
            part, length = part[:left], left
        left -= length
        while length:
            if not room or len(batch) == _MAX_IO_PARTS:
                batches.append(batch)
                batch, room = [], MAX_IO_BYTES
            if length <= room:
                batch.append(part)
                room -= length
                break
            batch.append(part[:room])
            part, length = part[room:], length - room
            room = 0
    if batch:
        batches.append(batch)
    return batches


def _after(batch: list[memoryview], done: int) -> list[memoryview]:
    """What of `batch` is left once a call moved its first `done` bytes."""
    while batch and done >= len(batch[0]):
        done -= len(batch[0])
        batch = batch[1:]
    if batch and done:
        batch = [batch[0][done:], *batch[1:]]
    return batch


def _error_text(error: Exception) -> str:
    """What went wrong, without the file name an `OSError` quotes (the root, at full length)."""
    if isinstance(error, OSError) and error.strerror:
        return f"[Errno {error.errno}] {error.strerror}"
    return shown(str(error))


def _file_count(contents: ShardContents) -> int:
    """How many files the scanned shard folder held, kvwire's or not."""
    return len(contents.entries) + len(contents.temporary_files) + contents.others


def _unlink_regular_file(name: str, folder_fd: int) -> bool:
    """Remove `name` from the open folder if it is a regular file (a link or a FIFO is not
    kvwire's)."""
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode):
            return False
    except OSError:
        return False
    return _unlink_quietly(name, folder_fd)


def _unlink_quietly(name: str, folder_fd: int) -> bool:
    try:
        os.unlink(name, dir_fd=folder_fd)
    except OSError:
        return False
    return True
