"""The CPU time kvwire's own threads take in a ``vllm serve``: a cost the wall clock hides.

On a shared 2-core host one configuration's throughput moves by a tenth or
more from run to run, more than a CPU pool's copies could cost. The CPU
time of the threads that make them does not move with the host's other
work: kvwire names its I/O threads at the OS level (``kvwire-...``,
:mod:`kvwire.media.io_threads`), and this module sums what the kernel
counted for them, over every process of a server. The engine's own threads
cannot be measured so: vLLM's engine core and worker wait for each other
by spinning, so their CPU time is about the wall time, whatever they
computed.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable

PROC = pathlib.Path("/proc")
# utime and stime, in clock ticks: fields 14 and 15 of /proc/<pid>/task/<tid>/stat, the
# 12th and 13th after the name's closing parenthesis.
_UTIME_AFTER_NAME = 11
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def server_pid(port: int, proc: pathlib.Path = PROC) -> int | None:
    """The process of the ``vllm serve`` listening on ``port`` (by its command line)."""
    wanted = f"\0--port\0{port}\0".encode()
    for entry in _pids(proc):
        try:
            command = (proc / str(entry) / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if b"vllm.entrypoints.openai.api_server" in command and wanted in command:
            return entry
    return None


def process_tree(root: int, proc: pathlib.Path = PROC) -> list[int]:
    """``root`` and every process under it (the engine core, its workers)."""
    children: dict[int, list[int]] = {}
    for entry in _pids(proc):
        stat = _read(proc / str(entry) / "stat")
        if stat is not None:
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(parent, []).append(entry)
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending += children.get(pid, [])
    return tree


def cpu_seconds_of_threads(
    pids: Iterable[int], prefix: str = "kvwire", proc: pathlib.Path = PROC
) -> float:
    """CPU seconds (user and system) of the threads of ``pids`` whose OS name starts with
    ``prefix``; a thread that ended before this call is not counted."""
    ticks = 0
    for pid in pids:
        tasks = proc / str(pid) / "task"
        try:
            threads = list(tasks.iterdir())
        except OSError:
            continue
        for thread in threads:
            stat = _read(thread / "stat")
            if stat is None:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            if name.startswith(prefix):
                fields = stat[stat.rindex(")") + 2 :].split()
                ticks += int(fields[_UTIME_AFTER_NAME]) + int(fields[_UTIME_AFTER_NAME + 1])
    return ticks / _TICKS_PER_SECOND


def kvwire_cpu_seconds(port: int, proc: pathlib.Path = PROC) -> float | None:
    """The CPU seconds kvwire's threads in the server on ``port`` have taken so far."""
    root = server_pid(port, proc)
    if root is None:
        return None
    return cpu_seconds_of_threads(process_tree(root, proc), proc=proc)


def _pids(proc: pathlib.Path) -> list[int]:
    return [int(entry.name) for entry in proc.iterdir() if entry.name.isdigit()]


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the process or thread ended meanwhile
        return None
