"""Who may read the KV files of a shared-storage directory: their modes and the directory's owner.

KV blocks can reveal the prompts they were computed from, so by default
kvwire's files are its user's alone (`private`: entries 0600, folders 0700).
`group` shares them with the group of the directory, for engines that run
as different users of one group: entries 0660 and folders 2770, so that
every member's engine reads, replaces and evicts the others' entries, and
the set-group-ID bit keeps the folders kvwire creates in that group. The
modes are exact whatever the process umask is.
"""

from __future__ import annotations

import os
import stat

import attrs


@attrs.frozen
class FileModes:
    """The permission bits of the entries and of the folders kvwire creates."""

    name: str
    entry: int
    folder: int


PRIVATE = FileModes("private", entry=0o600, folder=0o700)
GROUP = FileModes("group", entry=0o660, folder=stat.S_ISGID | 0o770)
_MODES = {modes.name: modes for modes in (PRIVATE, GROUP)}
FILE_MODE_NAMES = tuple(_MODES)


def file_modes(name: str) -> FileModes:
    """The modes called `name` (one of `FILE_MODE_NAMES`)."""
    try:
        return _MODES[name]
    except KeyError:
        raise ValueError(f"file mode {name!r} is not one of {', '.join(FILE_MODE_NAMES)}") from None


def process_umask() -> int:
    """The umask of this process, read without changing it where the system allows."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # No /proc: the only portable way sets it; put it back at once.
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def make_folder(path: str, modes: FileModes) -> None:
    """Create the folder `path` with exactly `modes.folder` (`FileExistsError` if present).

    `mkdir` drops the umask's bits and, on Linux, the set-group-ID bit;
    the chmod sets what was asked for. Folders are few (one per layout and
    shard), so the second call costs nothing that counts.
    """
    os.mkdir(path, modes.folder & 0o777)
    os.chmod(path, modes.folder)


def writers_beyond(path: str, modes: FileModes) -> str | None:
    """Who, beyond those `modes` share with, may write in the directory `path`; or None."""
    mode = os.stat(path).st_mode
    if mode & stat.S_IWOTH:
        return "every user"
    if mode & stat.S_IWGRP and not modes.folder & stat.S_IWGRP:
        return "its group"
    return None


def owner_problem(path: str) -> str | None:
    """Why this process should not trust the directory `path` (another user owns it), or None."""
    owner = os.stat(path).st_uid
    if owner == os.geteuid():
        return None
    return f"is owned by uid {owner}, not by this process's uid {os.geteuid()}"
