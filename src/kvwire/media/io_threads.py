"""A handler's I/O threads: daemon threads for transfer jobs, which never hold up the exit.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the
interpreter exits, without a deadline: one job stuck in a store that never
answers (given up on long before, see `kvwire.media.JobLedger`)
would keep the process from ever exiting. These threads are daemons: at exit
a job still running is dropped, as its caller has already counted it failed.
Same calls as the executor: `IOThreads.submit` returns a
`Future`, `IOThreads.shutdown` cancels what
has not started.

On Linux each thread also carries its name at the OS level (the first 15
bytes, all Linux keeps), so that `top -H`, `ps -L`, `perf` and
`/proc/<pid>/task/*/comm` tell kvwire's copies apart from the engine's
threads and count the CPU time they take.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["IOThreads"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class IOThreads:
    """`num_threads` daemon threads named `name-N`; each runs `initializer` first."""

    def __init__(
        self, num_threads: int, name: str, initializer: Callable[[], object] | None = None
    ) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._initializer = initializer
        self._lock = threading.Lock()
        self._shut_down = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{index}", daemon=True)
            for index in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run `fn(*args)` on a free thread; its future."""
        future: Future[_T] = Future()
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancel the jobs not started and let the threads end; waits for none of them."""
        with self._lock:
            self._shut_down = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)

    def _serve(self) -> None:
        _name_os_thread(threading.current_thread().name)
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:
                # A setting for speed: the thread still serves without it.
                logger.exception("%s: thread set-up failed", threading.current_thread().name)
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                result = fn(*args)
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(result)
            del item, future, fn, args  # hold no job's arguments while idle


# prctl's option that names the calling thread; Linux keeps 15 bytes of it and a NUL.
_PR_SET_NAME = 15
_OS_THREAD_NAME_BYTES = 15


def _name_os_thread(name: str) -> None:
    """Name the calling thread at the OS level (Linux; elsewhere nothing), cut to 15 bytes."""
    prctl = _prctl()
    if prctl is not None:
        # A name is a label: a failure leaves the thread as it was, and its work unchanged.
        prctl(_PR_SET_NAME, name.encode()[:_OS_THREAD_NAME_BYTES], 0, 0, 0)


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return function
