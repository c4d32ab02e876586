"""A digest of every byte of a file, computed once and remembered while the file is unchanged.

A model's and an adapter's identity (`kvwire.model_identity`) digest
each weight file whole: a sample would let a fine-tune that changes only
unsampled bytes pass for its base. Reading 100 GB takes minutes, so each
file's digest is remembered in a per-user cache, keyed by what the kernel
says of the open file: its device, inode, size, modification and change
times (`st_ctime_ns`, which no unprivileged process can set back). Any
write, truncation, rename over it or `touch` changes the key, and the file
is read again.

The cache is one small JSON file per weight file in
`$XDG_CACHE_HOME/kvwire/file-digests` (`~/.cache/...`): a directory
kvwire creates owner-only (0700) and uses only while it is a real directory
(not a link), owned by this user, that no one else can write. Entries are
written to a temporary file and renamed into place (0600), named by a digest
of their key (so never a path of anyone's choosing), and believed only when
they parse, their key is the file's, and their digest has the right form;
anything else is read again and written over. At most `MAX_ENTRIES`
are kept: the least recently written go first. A directory kvwire cannot
use costs the cache, never the digest.

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
import time
from typing import Any

import attrs

from kvwire.exceptions import FileChangedError as FileChangedError
from kvwire.redaction import shown

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

_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.json")
_TEMPORARY_NAME = re.compile(r"\.[0-9a-f]{16}\.tmp")
# A temporary entry this old was left by a process that died while writing it.
_ABANDONED_NS = 3600 * 1_000_000_000
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


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


def default_cache_directory() -> str:
    """`$XDG_CACHE_HOME/kvwire/file-digests`, or `~/.cache/kvwire/file-digests`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, *CACHE_FOLDER)


class FileDigests:
    """Whole-file digests (hex sha256), each remembered while its file's stamp stays the same.

    `cache_directory`: where they are remembered (empty: the default,
    `default_cache_directory`; None: nowhere, every file is read).
    `settle_ns`: how long ago a file must have last changed for its digest
    to be remembered.
    """

    def __init__(self, cache_directory: str | None = "", settle_ns: int = SETTLE_NS) -> None:
        self._directory = default_cache_directory() if cache_directory == "" else cache_directory
        self._settle_ns = settle_ns
        self._warned = False

    def digest(self, path: str) -> str:
        """The digest of every byte of the file at `path`; raises OSError if it cannot be read."""
        started = time.time_ns()
        # Non-blocking: a FIFO named like a weight file must not hang the start.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as file:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            stamp = FileStamp.of(status)
            cached = stamp.size > UNCACHED_BYTES
            remembered = self._recall(stamp) if cached else None
            if remembered is not None:
                return remembered
            digest = digest_open_file(file)
            if FileStamp.of(os.fstat(descriptor)) != stamp:
                raise FileChangedError(errno.EAGAIN, "the file changed while it was read", path)
        if cached and started - stamp.ctime_ns >= self._settle_ns:
            self._remember(stamp, digest)
        return digest

    def _recall(self, stamp: FileStamp) -> str | None:
        directory = self._open_directory(create=False)
        if directory is None:
            return None
        try:
            entry = _read_entry(directory, stamp.entry_name())
        finally:
            os.close(directory)
        if (
            isinstance(entry, dict)
            and entry.get("version") == ENTRY_VERSION
            and entry.get("stamp") == stamp.as_list()
            and isinstance(entry.get(ALGORITHM), str)
            and _HEX_DIGEST.fullmatch(entry[ALGORITHM])
        ):
            return str(entry[ALGORITHM])
        return None

    def _remember(self, stamp: FileStamp, digest: str) -> None:
        directory = self._open_directory(create=True)
        if directory is None:
            return
        try:
            body = json.dumps(
                {"version": ENTRY_VERSION, "stamp": stamp.as_list(), ALGORITHM: digest}
            ).encode()
            _write_entry(directory, stamp.entry_name(), body)
            _keep_newest(directory, MAX_ENTRIES)
        except OSError as error:
            self._cannot_use(f"writing an entry failed ({error.strerror or type(error).__name__})")
        finally:
            os.close(directory)

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
    except (OSError, ValueError):
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


def _keep_newest(directory: int, limit: int) -> None:
    """Delete the oldest entries past `limit`, and abandoned temporary ones.

    Only files named as kvwire names what it writes here are deleted.
    """
    listed = os.listdir(directory)
    now = time.time_ns()
    doomed = [
        name
        for name in listed
        if _TEMPORARY_NAME.fullmatch(name) and now - _written_ns(directory, name) > _ABANDONED_NS
    ]
    entries = [name for name in listed if _ENTRY_NAME.fullmatch(name)]
    if len(entries) > limit:
        entries.sort(key=lambda name: _written_ns(directory, name))
        doomed += entries[: len(entries) - limit]
    for name in doomed:
        try:
            os.unlink(name, dir_fd=directory)
        except OSError:
            continue


def _written_ns(directory: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False).st_mtime_ns
    except OSError:
        return 0
