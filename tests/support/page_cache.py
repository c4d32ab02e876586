"""Which of a file's pages the page cache holds, as the kernel says (``mincore``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (mapping faults none in)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vector = ctypes.create_string_buffer(pages)
            assert _libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vector.raw)
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
