"""Where a directory store keeps its files, and which files under its root are provably its own.

The entry of key `<layout>/<block hash>` is the file
`<root>/<layout>/<shard>/<block hash>`: the layout is a fingerprint in 32
lowercase hex digits, the block hash is in lowercase hex, and the shard
folder is its first two digits (so that no folder holds too many files). A
writer's temporary file lies beside the entry, as
`.<block hash>.<pid>.<serial>.tmp`.

The root is the user's directory, and may hold the user's own files. kvwire
removes (evicts, sweeps, discards) only regular files whose names parse as
its entries or temporary files, in folders whose names parse as its layout
and shard folders, at exactly that depth. Anything else (other names, other
depths, symbolic links, FIFOs, folders) belongs to someone else and is left
alone, and so is any folder that holds it.

Removals go through the folders themselves, never through paths: a shard
folder is opened from the root without following a link at the layout or
shard level, scanned through that descriptor, and its files are removed
relative to it, once it is checked to be the folder that was scanned. Who
may write in a shared directory can swap a folder for a link to someone's
files at any moment; such a swap then leads kvwire nowhere.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import TypeAlias

import attrs

_LAYOUT = re.compile(r"[0-9a-f]{32}")
_SHARD = re.compile(r"[0-9a-f]{2}")
# A block hash of 1 to 64 bytes, as bytes.hex() writes it.
_BLOCK_HASH = r"(?:[0-9a-f]{2}){1,64}"
_ENTRY = re.compile(_BLOCK_HASH)
_TEMPORARY = re.compile(rf"\.({_BLOCK_HASH})\.[0-9]+\.[0-9]+\.tmp")
_KEY = re.compile(rf"({_LAYOUT.pattern})/({_BLOCK_HASH})")
# A folder of kvwire's is opened only as itself: a link in its place fails the open.
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# A folder's (st_dev, st_ino): which folder a scan listed.
FolderIdentity: TypeAlias = tuple[int, int]


def temporary_name(name: str, pid: int, serial: int) -> str:
    """The name of a temporary file that becomes the entry `name` once complete."""
    return f".{name}.{pid}.{serial}.tmp"


@attrs.frozen
class Shard:
    """A shard folder of kvwire's: `<root>/<layout>/<name>`."""

    layout: str
    name: str
    path: str

    def key_of(self, entry_name: str) -> str:
        """The store key of the entry called `entry_name` in this shard."""
        return f"{self.layout}/{entry_name}"


def entry_location(root: str, key: str) -> tuple[Shard, str]:
    """The shard folder of `key`'s entry and the entry's file name; `ValueError` for a
    key of another form."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(
            f"store key {key!r} is not '<layout>/<block hash>' "
            "(32 lowercase hex digits, '/', an even number of lowercase hex digits)"
        )
    layout, name = match.groups()
    return Shard(layout, name[:2], os.path.join(root, layout, name[:2])), name


def entry_path(root: str, key: str) -> str:
    """The file that holds `key`'s entry; `ValueError` for a key of another form."""
    shard, name = entry_location(root, key)
    return os.path.join(shard.path, name)


@attrs.frozen
class ScannedFile:
    """A regular file of kvwire's, as a scan found it."""

    name: str
    size: int
    mtime: float


@attrs.frozen
class OpenShard:
    """A shard folder held open, and its layout folder: what removals are relative to."""

    layout_fd: int
    fd: int


@contextlib.contextmanager
def open_shard(
    root: str, shard: Shard, scanned: FolderIdentity | None = None
) -> Iterator[OpenShard | None]:
    """`shard`'s folder and its layout folder, opened from `root` through real folders only.

    None when either is missing or is not a real folder (a link to one
    included), or, given `scanned`, when the shard folder is no longer the
    folder that was scanned.
    """
    opened: list[int] = []
    try:
        try:
            # The root is the user's choice, and may be a link: it is followed.
            opened.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            opened.append(os.open(shard.layout, _FOLDER_FLAGS, dir_fd=opened[-1]))
            opened.append(os.open(shard.name, _FOLDER_FLAGS, dir_fd=opened[-1]))
            info = os.fstat(opened[-1])
        except OSError:
            folder = None
        else:
            same = scanned is None or (info.st_dev, info.st_ino) == scanned
            folder = OpenShard(opened[1], opened[2]) if same else None
        yield folder
    finally:
        for fd in opened:
            os.close(fd)


@attrs.define
class ShardContents:
    """What one scan of a shard folder found: kvwire's regular files, and a count of the rest.

    `folder` is the identity of the folder listed (None: there was no real
    folder); only files of that folder may be removed on the scan's word.
    """

    entries: list[ScannedFile] = attrs.field(factory=list)
    temporary_files: list[ScannedFile] = attrs.field(factory=list)
    others: int = 0
    folder: FolderIdentity | None = None


def layout_folders(root: str) -> Iterator[os.DirEntry[str]]:
    """kvwire's layout folders under `root` (real folders, never links to one)."""
    with contextlib.suppress(OSError), os.scandir(root) as found:
        for entry in found:
            if _LAYOUT.fullmatch(entry.name) and _is_real_folder(entry):
                yield entry


def shards(root: str, layout: str | None = None) -> Iterator[Shard]:
    """kvwire's shard folders under `root`: of every layout, or of `layout` only."""
    if layout is None:
        layouts = [(entry.name, entry.path) for entry in layout_folders(root)]
    elif _LAYOUT.fullmatch(layout):
        layouts = [(layout, os.path.join(root, layout))]
    else:
        raise ValueError(f"layout {layout!r} is not a fingerprint of 32 lowercase hex digits")
    for layout_name, layout_path in layouts:
        with contextlib.suppress(OSError), os.scandir(layout_path) as found:
            for entry in found:
                if _SHARD.fullmatch(entry.name) and _is_real_folder(entry):
                    yield Shard(layout_name, entry.name, entry.path)


def scan_shard(root: str, shard: Shard) -> ShardContents:
    """Sort a shard folder's files into kvwire's entries, its temporary files and the rest.

    A vanished folder, or a link in its place, scans as empty. Only regular
    files count as kvwire's (from the folder listing's file types).
    """
    contents = ShardContents()
    with open_shard(root, shard) as folder:
        if folder is None:
            return contents
        info = os.fstat(folder.fd)
        contents.folder = (info.st_dev, info.st_ino)
        with contextlib.suppress(OSError), os.scandir(folder.fd) as found:
            for entry in found:
                kind = _kind_of(entry, shard)
                if kind is None:
                    contents.others += 1
                    continue
                try:
                    # Relative to the open folder, while it is open.
                    file_info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed since the listing
                scanned = ScannedFile(entry.name, file_info.st_size, file_info.st_mtime)
                (contents.entries if kind == "entry" else contents.temporary_files).append(scanned)
    return contents


def remove_empty_shard(root: str, shard: Shard, unchanged_since: float | None = None) -> bool:
    """Remove `shard`'s folder if it is empty; whether it went (never raises).

    With `unchanged_since` (a time), only a folder whose contents have not
    changed since then: a writer that has just created a folder is about to
    put its file in it, and must not find it gone.
    """
    with open_shard(root, shard) as folder:
        if folder is None:
            return False
        try:
            if unchanged_since is not None and os.fstat(folder.fd).st_mtime > unchanged_since:
                return False
            os.rmdir(shard.name, dir_fd=folder.layout_fd)
        except OSError:
            return False
    return True


def remove_empty_layout(root: str, layout: str) -> bool:
    """Remove the layout folder `layout` if it is empty; whether it went (never raises)."""
    try:
        # rmdir never follows a link in the last place: one there fails.
        os.rmdir(os.path.join(root, layout))
    except OSError:
        return False
    return True


def _is_real_folder(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _kind_of(entry: os.DirEntry[str], shard: Shard) -> str | None:
    """ "entry" or "temporary" for a file of kvwire's in `shard`; None for anything else."""
    try:
        if not entry.is_file(follow_symlinks=False):
            return None
    except OSError:
        return None
    name = entry.name
    if _ENTRY.fullmatch(name) and name[:2] == shard.name:
        return "entry"
    temporary = _TEMPORARY.fullmatch(name)
    if temporary is not None and temporary.group(1)[:2] == shard.name:
        return "temporary"
    return None
