"""Reading a file a user names (a profile, a prompts file): a regular file, bounded in size.

A path may name something that is not a file to read once: a FIFO blocks
`open()` until a writer comes (forever, if none does), `/dev/zero` never
ends, `/dev/stdin` may be a terminal, a directory or a socket cannot be read.
So the path is opened without blocking, refused unless it is a regular file,
refused by its size before a byte is read, and read no further than the bound
(a file that grows while it is read is cut off there and refused).
"""

from __future__ import annotations

import os
import stat

from kvwire.common.redaction import shown
from kvwire.exceptions import FileRefused as FileRefused

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them.

    Raises `kvwire.exceptions.FileRefused` for anything but a regular file and for a
    file longer than `limit` (checked by its size first, without reading
    it), `OSError` when it cannot be opened or read.
    """
    # Checked by name first: a socket cannot even be opened (ENXIO says nothing).
    _check_regular(os.stat(path), limit)
    # O_NONBLOCK: should the path name a FIFO by now, opening it returns at
    # once instead of waiting for a writer; the descriptor is checked again.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check_regular(os.fstat(descriptor), limit)
    except BaseException:
        os.close(descriptor)
        raise
    with os.fdopen(descriptor, "rb", buffering=0) as file:
        content = bytearray()
        while len(content) <= limit:
            piece = file.read(limit + 1 - len(content))
            if not piece:
                break
            content += piece
    if len(content) > limit:
        raise FileRefused(f"it grew past the {limit} bytes accepted while it was read")
    return bytes(content)


def _check_regular(status: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(status.st_mode):
        raise FileRefused(f"it is {_kind(status.st_mode)}, not a regular file")
    if status.st_size > limit:
        raise FileRefused(f"it holds {status.st_size} bytes, more than the {limit} accepted")


def shown_path(path: str | os.PathLike[str]) -> str:
    """How an error names `path`: as given, or escaped and cut when unprintable or long."""
    text = os.fspath(path)
    return text if text.isprintable() and len(text) <= 4096 else shown(text, limit=200)


def _kind(mode: int) -> str:
    for is_kind, name in _KINDS:
        if is_kind(mode):
            return name
    return "a special file"
