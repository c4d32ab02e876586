"""A digest of every byte of a file, computed once and remembered while the file is unchanged.

A model's and an adapter's identity (`kvwire.identity.model`) digest
each weight file whole: a sample would let a fine-tune that changes only
unsampled bytes pass for its base. Reading 100 GB takes minutes, so each
file's digest is remembered in a per-user cache, keyed by what the kernel
says of the open file: its device, inode, size, modification and change
times (`st_ctime_ns`, which no unprivileged process can set back). Any
write, truncation, rename over it or `touch` changes the key, and the file
is read again.

What the key cannot see: a write through a shared memory mapping
(`mmap`, `numpy.memmap` in `r+` mode) to a page that mapping has already
written changes the bytes without any page fault, so the kernel updates
neither time (measured on ext4 and tmpfs), and the remembered digest is
believed. `KVWIRE_DIGEST_CACHE=off` (`DIGEST_CACHE_VARIABLE`) turns the
cache off: every file is read whole at each call.

The cache is one small JSON file per weight file in
`$XDG_CACHE_HOME/kvwire/file-digests` (`~/.cache/...`): a directory
kvwire creates owner-only (0700) and uses only while it is a real directory
(not a link), owned by this user, that no one else can write. Entries are
written to a temporary file and renamed into place (0600), named by a digest
of their key (so never a path of anyone's choosing), and believed only when
they parse, hold exactly an entry's fields with their types, their key is the
file's, and their digest has the right form; anything else (a corrupted or
hostile entry included) is read again and written over.

The cache holds at least `MAX_ENTRIES` entries, and at least as many as the
largest model one `FileDigests` has digested (`keeping_model`); pruning
waits until a model's digests are done and deletes none of its entries.
Past the bound by a quarter, the least recently used go first, down to the
bound: the directory is listed once per `FileDigests` and once per
pruning, so a write costs O(1) amortized. A directory kvwire cannot use
costs the cache, never the digest.

A file whose change time is within `SETTLE_NS` of the digest's start
is digested but not remembered: a file system whose clock is coarse could
give a write that follows the same change time.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs

from kvwire.common.redaction import shown
from kvwire.exceptions import FileChangedError as FileChangedError
from kvwire.exceptions import ModelIdentityError

logger = logging.getLogger(__name__)

ALGORITHM = "sha256"
# Each entry's own version: a change of what is digested makes old entries misses.
ENTRY_VERSION = 1
MAX_ENTRIES = 4096
ENTRY_BYTES_LIMIT = 4096
READ_BYTES = 8 * 1024 * 1024
# Files up to this size are read at each call: cheaper than an entry of their own.
UNCACHED_BYTES = 1024 * 1024
# FAT's 2 s is the coarsest change time of a file system weights live on.
SETTLE_NS = 2_000_000_000
CACHE_FOLDER = ("kvwire", "file-digests")
DIGEST_CACHE_VARIABLE = "KVWIRE_DIGEST_CACHE"
_CACHE_SETTINGS = {"": True, "on": True, "off": False}

_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.json")
_TEMPORARY_NAME = re.compile(r"\.[0-9a-f]{16}\.tmp")
# A temporary entry this old was left by a process that died while writing it.
_ABANDONED_NS = 3600 * 1_000_000_000
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_ENTRY_FIELDS = frozenset({"version", "stamp", ALGORITHM})


@attrs.frozen
class FileStamp:
    """What the kernel says of a file that changes whenever its bytes do."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileStamp:
        return cls(
            status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns
        )

    def as_list(self) -> list[int]:
        return [self.device, self.inode, self.size, self.mtime_ns, self.ctime_ns]

    def entry_name(self) -> str:
        key = f"{ENTRY_VERSION}:{ALGORITHM}:{self.as_list()}".encode()
        return hashlib.sha256(key).hexdigest() + ".json"


def default_cache_directory() -> str | None:
    """`$XDG_CACHE_HOME/kvwire/file-digests`, or `~/.cache/kvwire/file-digests`.

    None when `KVWIRE_DIGEST_CACHE` is `off`. Raises `ModelIdentityError`
    naming the variable for a value other than `on`, `off` or empty.
    """
    setting = os.environ.get(DIGEST_CACHE_VARIABLE, "")
    if setting not in _CACHE_SETTINGS:
        raise ModelIdentityError(
            f"{DIGEST_CACHE_VARIABLE}: expected 'off' (read every weight file whole at each "
            "start) or 'on' (the default, also when unset or empty: remember each file's "
            f"digest while its stat is unchanged), got {shown(setting)}"
        )
    if not _CACHE_SETTINGS[setting]:
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, *CACHE_FOLDER)


class FileDigests:
    """Whole-file digests (hex sha256), each remembered while its file's stamp stays the same.

    `cache_directory`: where they are remembered (empty: the default,
    `default_cache_directory`, which `KVWIRE_DIGEST_CACHE=off` turns off;
    None: nowhere, every file is read). `settle_ns`: how long ago a file
    must have last changed for its digest to be remembered. `max_entries`:
    the fewest entries the cache keeps. `files_read` (read-only) counts the
    files this object read whole, rather than recalled.
    """

    def __init__(
        self,
        cache_directory: str | None = "",
        settle_ns: int = SETTLE_NS,
        *,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self._directory = default_cache_directory() if cache_directory == "" else cache_directory
        self._settle_ns = settle_ns
        self._warned = False
        self._lock = threading.Lock()
        self._capacity = max_entries
        # Entries in the directory as this object last counted them, plus its writes since.
        self._entries: int | None = None
        # The entries of the models being digested now (`keeping_model`): never pruned.
        self._models_open = 0
        self._kept: set[str] = set()
        self._files_read = 0

    @property
    def files_read(self) -> int:
        return self._files_read

    @contextlib.contextmanager
    def keeping_model(self, file_count: int) -> Iterator[None]:
        """While inside, the cache holds `file_count` entries and prunes none digested here.

        For the files of one model: a model of more files than
        `MAX_ENTRIES` would otherwise evict its own entries as it writes them.
        """
        with self._lock:
            self._capacity = max(self._capacity, file_count)
            self._models_open += 1
        try:
            yield
        finally:
            with self._lock:
                self._models_open -= 1
                if not self._models_open:
                    # Pruning waited for every file's entry to be known: none is deleted.
                    self._prune_if_over(frozenset(self._kept))
                    self._kept.clear()

    def digest(self, path: str, expected: FileStamp | None = None) -> str:
        """The digest of every byte of the file at `path`; raises OSError if it cannot be read.

        `expected`: the stamp the file must still have (taken before its
        bytes were used elsewhere); another raises `FileChangedError`
        before anything is read.
        """
        started = time.time_ns()
        # Non-blocking: a FIFO named like a weight file must not hang the start.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as file:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            stamp = FileStamp.of(status)
            if expected is not None and stamp != expected:
                raise FileChangedError(errno.ESTALE, "changed since it was stamped", path)
            cached = stamp.size > UNCACHED_BYTES
            if cached:
                self._keep(stamp.entry_name())
            remembered = self._recall(stamp) if cached else None
            if remembered is not None:
                return remembered
            digest = digest_open_file(file)
            with self._lock:
                self._files_read += 1
            if FileStamp.of(os.fstat(descriptor)) != stamp:
                raise FileChangedError(errno.EAGAIN, "changed while it was read", path)
        if cached and started - stamp.ctime_ns >= self._settle_ns:
            self._remember(stamp, digest)
        return digest

    def _keep(self, name: str) -> None:
        with self._lock:
            if self._models_open:
                self._kept.add(name)

    def _recall(self, stamp: FileStamp) -> str | None:
        directory = self._open_directory(create=False)
        if directory is None:
            return None
        try:
            remembered = _remembered_digest(_read_entry(directory, stamp.entry_name()), stamp)
            if remembered is not None:
                # Used now: the least recently used entries are pruned first.
                with contextlib.suppress(OSError):
                    os.utime(stamp.entry_name(), dir_fd=directory, follow_symlinks=False)
            return remembered
        finally:
            os.close(directory)

    def _remember(self, stamp: FileStamp, digest: str) -> None:
        directory = self._open_directory(create=True)
        if directory is None:
            return
        try:
            body = json.dumps(
                {"version": ENTRY_VERSION, "stamp": stamp.as_list(), ALGORITHM: digest}
            ).encode()
            _write_entry(directory, stamp.entry_name(), body)
            with self._lock:
                if self._entries is None:
                    self._entries = _prune(directory, None, frozenset())
                else:
                    self._entries += 1
                if not self._models_open:
                    self._prune_if_over(frozenset(), directory)
        except OSError as error:
            self._cannot_use(f"writing an entry failed ({error.strerror or type(error).__name__})")
        finally:
            os.close(directory)

    def _prune_if_over(self, kept: frozenset[str], directory: int | None = None) -> None:
        """Prune down to the bound once a quarter past it; called with the lock held."""
        # A quarter over the bound before pruning: one listing per many writes.
        if self._entries is None or self._entries <= self._capacity + self._capacity // 4:
            return
        opened = self._open_directory(create=False) if directory is None else directory
        if opened is None:
            return
        try:
            self._entries = _prune(opened, self._capacity, kept)
        except OSError as error:
            self._cannot_use(f"pruning failed ({error.strerror or type(error).__name__})")
        finally:
            if directory is None:
                os.close(opened)

    def _open_directory(self, *, create: bool) -> int | None:
        """A descriptor of the cache directory, once it is known to be this user's alone."""
        if self._directory is None:
            return None
        try:
            if create:
                os.makedirs(os.path.dirname(self._directory), mode=0o700, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self._directory, 0o700)
            descriptor = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as error:
            self._cannot_use(error.strerror or type(error).__name__)
            return None
        status = os.fstat(descriptor)
        if status.st_uid != os.geteuid() or status.st_mode & 0o077:
            os.close(descriptor)
            self._cannot_use("it is not this user's alone (owner-only, mode 0700, expected)")
            return None
        return descriptor

    def _cannot_use(self, why: str) -> None:
        # Once per process: the digests stay right, only slower.
        if not self._warned:
            self._warned = True
            logger.warning(
                "kvwire: the weight digest cache %s cannot be used: %s; every weight file is "
                "read whole at each start",
                shown(self._directory),
                why,
            )


def digest_open_file(file: Any) -> str:
    """The hex digest of what is left to read of a binary `file`, read in large pieces."""
    digest = hashlib.new(ALGORITHM)
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    while True:
        count = file.readinto(buffer)
        if not count:
            break
        # hashlib releases the GIL for large updates: files digest in parallel threads.
        digest.update(view[:count])
    return digest.hexdigest()


def _remembered_digest(entry: object, stamp: FileStamp) -> str | None:
    """The digest `entry` holds for `stamp`, if it is exactly an entry kvwire writes."""
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        return None
    version, stamp_list, digest = entry["version"], entry["stamp"], entry[ALGORITHM]
    # `type(...) is int`: JSON's true would equal 1, and 1.0 would equal 1.
    if type(version) is not int or version != ENTRY_VERSION:
        return None
    if not isinstance(stamp_list, list) or any(type(value) is not int for value in stamp_list):
        return None
    if stamp_list != stamp.as_list() or not isinstance(digest, str):
        return None
    return digest if _HEX_DIGEST.fullmatch(digest) else None


def _read_entry(directory: int, name: str) -> object:
    try:
        descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
    except OSError:
        return None
    try:
        status = os.fstat(descriptor)
        if (
            not stat.S_ISREG(status.st_mode)
            or status.st_uid != os.geteuid()
            or status.st_size > ENTRY_BYTES_LIMIT
        ):
            return None
        text = os.read(descriptor, ENTRY_BYTES_LIMIT + 1)
        return json.loads(text)
    # Any entry that does not parse is a miss: deep nesting raises RecursionError.
    except Exception:
        return None
    finally:
        os.close(descriptor)


def _write_entry(directory: int, name: str, body: bytes) -> None:
    temporary = f".{secrets.token_hex(8)}.tmp"
    descriptor = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=directory
    )
    try:
        try:
            os.write(descriptor, body)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=directory)
        raise


def _prune(directory: int, limit: int | None, kept: frozenset[str]) -> int:
    """Delete abandoned temporary entries and, past `limit`, the least recently used ones.

    None of `kept` is deleted, and only files named as kvwire names what it
    writes here. Returns how many entries are left.
    """
    listed = os.listdir(directory)
    now = time.time_ns()
    for name in listed:
        if _TEMPORARY_NAME.fullmatch(name) and now - _used_ns(directory, name) > _ABANDONED_NS:
            _unlink(directory, name)
    entries = [name for name in listed if _ENTRY_NAME.fullmatch(name)]
    if limit is None or len(entries) <= limit:
        return len(entries)
    candidates = sorted(
        (name for name in entries if name not in kept), key=lambda name: _used_ns(directory, name)
    )
    doomed = candidates[: len(entries) - limit]
    for name in doomed:
        _unlink(directory, name)
    return len(entries) - len(doomed)


def _unlink(directory: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=directory)


def _used_ns(directory: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False).st_mtime_ns
    except OSError:
        return 0
