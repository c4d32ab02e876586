"""What this machine's memory can hold, for checking configured sizes before they are allocated.

A buffer or cache sized beyond the machine's memory does not fail cleanly
when it is allocated: it ends in a `MemoryError` traceback, or the kernel
kills the process after it has pushed everything else into swap. Sizes are
compared with `machine_memory_bytes` when a configuration is read
(`kvwire check` and engine start read it the same way), and the error
names the field, the bytes it would need and the bytes there are.
"""

from __future__ import annotations

import functools
import os
import pathlib

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
# cgroup v2, then v1: a container may hold far less than the host has.
_CGROUP_LIMITS = (
    pathlib.Path("/sys/fs/cgroup/memory.max"),
    pathlib.Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


@functools.lru_cache(maxsize=1)
def machine_memory_bytes() -> int | None:
    """Bytes of memory this process may use: physical memory, or its cgroup's limit if lower.

    None when the platform says neither (then no size is refused for it).
    """
    limits = [limit for limit in (_physical_memory(), _cgroup_limit()) if limit]
    return min(limits) if limits else None


def memory_shortfall(needed_bytes: int) -> str | None:
    """None when `needed_bytes` fits in this machine's memory, else the sentence that says not.

    `"more than this machine's memory, 15.5 GiB (16,642,998,272 bytes)"`.
    """
    available = machine_memory_bytes()
    if available is None or needed_bytes <= available:
        return None
    return f"more than this machine's memory, {describe_bytes(available)}"


def describe_bytes(count: int) -> str:
    """`"1.5 GiB (1,610,612,736 bytes)"`; an absurd count is described by its size alone."""
    if count.bit_length() > 128:
        # Formatting every digit of a 300-digit count helps no one (and is
        # refused past 4300 digits).
        return f"about 2**{count.bit_length() - 1} bytes"
    value = float(count)
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{count:,} bytes"
    return f"{value:.1f} {_UNITS[unit]} ({count:,} bytes)"


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX, or the name is unknown
        return _meminfo_total()


def _meminfo_total() -> int | None:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            name, _, amount = line.partition(":")
            if name == "MemTotal":
                return int(amount.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit() -> int | None:
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        # "max" (v2) or a huge number (v1) mean no limit.
        if text.isdigit() and int(text) < 2**62:
            return int(text)
    return None
