"""Where a directory store keeps its files, and which files under its root are provably its own.

The entry of key ``<layout>/<block hash>`` is the file
``<root>/<layout>/<shard>/<block hash>``: the layout is a fingerprint in 32
lowercase hex digits, the block hash is in lowercase hex, and the shard
folder is its first two digits (so that no folder holds too many files). A
writer's temporary file lies beside the entry, as
``.<block hash>.<pid>.<serial>.tmp``.

The root is the user's directory, and may hold the user's own files. kvwire
removes (evicts, sweeps, discards) only regular files whose names parse as
its entries or temporary files, in folders whose names parse as its layout
and shard folders, at exactly that depth. Anything else (other names, other
depths, symbolic links, FIFOs, folders) belongs to someone else and is left
alone, and so is any folder that holds it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import attrs

_LAYOUT = re.compile(r"[0-9a-f]{32}")
_SHARD = re.compile(r"[0-9a-f]{2}")
# A block hash of 1 to 64 bytes, as bytes.hex() writes it.
_BLOCK_HASH = r"(?:[0-9a-f]{2}){1,64}"
_ENTRY = re.compile(_BLOCK_HASH)
_TEMPORARY = re.compile(rf"\.({_BLOCK_HASH})\.[0-9]+\.[0-9]+\.tmp")
_KEY = re.compile(rf"({_LAYOUT.pattern})/({_BLOCK_HASH})")


def entry_path(root: str, key: str) -> str:
    """The file that holds ``key``'s entry; ``ValueError`` for a key of another form."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(
            f"store key {key!r} is not '<layout>/<block hash>' "
            "(32 lowercase hex digits, '/', an even number of lowercase hex digits)"
        )
    layout, name = match.groups()
    return os.path.join(root, layout, name[:2], name)


def temporary_name(name: str, pid: int, serial: int) -> str:
    """The name of a temporary file that becomes the entry ``name`` once complete."""
    return f".{name}.{pid}.{serial}.tmp"


@attrs.frozen
class Shard:
    """A shard folder of kvwire's: ``<root>/<layout>/<name>``."""

    layout: str
    name: str
    path: str

    def key_of(self, entry_name: str) -> str:
        """The store key of the entry called ``entry_name`` in this shard."""
        return f"{self.layout}/{entry_name}"


@attrs.define
class ShardContents:
    """What one scan of a shard folder found: kvwire's regular files, and a count of the rest."""

    entries: list[os.DirEntry[str]] = attrs.field(factory=list)
    temporary_files: list[os.DirEntry[str]] = attrs.field(factory=list)
    others: int = 0


def layout_folders(root: str) -> Iterator[os.DirEntry[str]]:
    """kvwire's layout folders under ``root`` (real folders, never links to one)."""
    with contextlib.suppress(OSError), os.scandir(root) as found:
        for entry in found:
            if _LAYOUT.fullmatch(entry.name) and _is_real_folder(entry):
                yield entry


def shards(root: str, layout: str | None = None) -> Iterator[Shard]:
    """kvwire's shard folders under ``root``: of every layout, or of ``layout`` only."""
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


def scan_shard(shard: Shard) -> ShardContents:
    """Sort a shard folder's files into kvwire's entries, its temporary files and the rest.

    A vanished folder scans as empty. Only regular files count as kvwire's
    (from the folder listing's file types: no extra call per file).
    """
    contents = ShardContents()
    with contextlib.suppress(OSError), os.scandir(shard.path) as found:
        for entry in found:
            name = entry.name
            if _is_regular_file(entry):
                if _ENTRY.fullmatch(name) and name[:2] == shard.name:
                    contents.entries.append(entry)
                    continue
                temporary = _TEMPORARY.fullmatch(name)
                if temporary is not None and temporary.group(1)[:2] == shard.name:
                    contents.temporary_files.append(entry)
                    continue
            contents.others += 1
    return contents


def remove_empty_folder(path: str, unchanged_since: float | None = None) -> bool:
    """Remove the folder ``path`` if it is empty; whether it went (never raises).

    With ``unchanged_since`` (a time), only a folder whose contents have not
    changed since then: a writer that has just created a folder is about to
    put its file in it, and must not find it gone.
    """
    try:
        if unchanged_since is not None and os.lstat(path).st_mtime > unchanged_since:
            return False
        os.rmdir(path)
    except OSError:
        return False
    return True


def _is_real_folder(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _is_regular_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False
