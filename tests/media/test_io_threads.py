"""I/O threads carry their names at the OS level, where the tools that count CPU time see them."""

from __future__ import annotations

import pathlib
import threading

from kvwire.media.io_threads import IOThreads


def os_thread_name() -> str:
    """The calling thread's name as Linux keeps it (what top -H and ps -L show)."""
    return pathlib.Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def test_each_thread_is_named_at_the_os_level_as_in_python() -> None:
    threads = IOThreads(2, "kvwire-load")
    try:
        names = {threads.submit(os_thread_name).result(timeout=10) for _ in range(20)}
    finally:
        threads.shutdown()
    assert names <= {"kvwire-load-0", "kvwire-load-1"}
    assert names


def test_a_long_name_keeps_its_first_15_bytes_and_the_thread_still_serves() -> None:
    threads = IOThreads(1, "kvwire-cpu-save")
    try:
        assert threads.submit(os_thread_name).result(timeout=10) == "kvwire-cpu-save"
        assert (
            threads.submit(lambda: threading.current_thread().name).result(timeout=10)
            == "kvwire-cpu-save-0"
        )
    finally:
        threads.shutdown()


def test_the_calling_thread_keeps_its_own_name() -> None:
    before = os_thread_name()
    threads = IOThreads(1, "kvwire-save")
    try:
        threads.submit(int).result(timeout=10)
    finally:
        threads.shutdown()
    assert os_thread_name() == before
