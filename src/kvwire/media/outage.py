"""When a server is down: answer at once, never wait past a deadline, probe in the background.

Shared by every medium that asks a server from the scheduler's thread: the
Redis store (each master's, on a cluster) and the peer medium's directory.

An outage is found by the call that fails, or that is not answered within
its deadline. A server that is hung rather than gone (stopped, its host
unreachable) keeps a connection open and answers nothing, so a socket
timeout alone would cost every call its full length; `OutageTracker.call`
therefore runs the call on a thread of the tracker's and waits for it only
until its deadline. From the first failure on, every call answers at once
without touching the network (the caller's fallback: a miss, a dropped or
queued write), and a background thread probes the server every
`retry_interval_s`, each probe bounded by the caller's own timeouts. The
outage ends as soon as a probe is answered, or a call made meanwhile
succeeds. Warnings are rate-limited and name the server as the caller
shows it (without credentials).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvwire.exceptions import ServerUnavailable
from kvwire.media.io_threads import IOThreads

__all__ = ["OutageTracker", "ServerUnavailable"]

_T = TypeVar("_T")

# Threads a tracker runs its calls on. A call given up on at its deadline
# holds one until the server answers it or its socket times out; by then
# the tracker sends no more calls, so a few cover the callers that were
# waiting together when the server hung.
_CALL_THREADS = 4
# How long close() waits for a probe in progress (itself bounded by the
# caller's socket timeouts) before leaving it to end on its own.
_PROBER_JOIN_S = 5.0


class OutageTracker:
    """Whether a server is considered down; bounded calls; the reconnect probe; warnings.

    `server` names it in warnings (`"Redis at redis://host:6379/0"`), with
    no credentials; `while_down` says what callers do meanwhile ("lookups
    miss, ..."). `probe` raises one of `errors` while the server cannot
    be reached; `errors` are also what a failing call raises, shown through
    `describe`, which must keep secrets out. Warnings go to `logger`.
    """

    def __init__(
        self,
        server: str,
        *,
        while_down: str,
        probe: Callable[[], object],
        errors: tuple[type[BaseException], ...],
        describe: Callable[[BaseException], str],
        retry_interval_s: float,
        warning_interval_s: float,
        logger: logging.Logger,
        thread_name: str,
    ) -> None:
        self._server = server
        self._while_down = while_down
        self._probe = probe
        self._errors = errors
        self._describe = describe
        self._retry_interval_s = retry_interval_s
        self._warning_interval_s = warning_interval_s
        self._logger = logger
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._down = False
        self._prober: threading.Thread | None = None
        self._threads: IOThreads | None = None
        self._closed = threading.Event()
        self._next_warning_at = 0.0
        self._suppressed_warnings = 0

    @property
    def is_down(self) -> bool:
        return self._down

    # ------------------------------------------------------------ bounded calls

    def call(self, what: str, work: Callable[[], _T], *, timeout_s: float, setting: str) -> _T:
        """`work()`'s result, waited for at most `timeout_s` (`setting` names it in warnings).

        Raises `ServerUnavailable` at once while the server is down,
        and when `work` raises one of the tracker's errors or is still
        running at the deadline: the outage then starts. A call given up on
        goes on in the background until its own timeouts end it; its outcome
        is dropped.
        """
        return self.wait(what, self.begin(what, work), time.monotonic() + timeout_s, setting)

    def begin(self, what: str, work: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Start `work` on a thread of the tracker's; `wait` for it.

        Two halves of `call`, so a caller can ask several servers at
        once and wait for all of them under one deadline.
        """
        if self._down:
            raise ServerUnavailable(f"{self._server} is down", asked=False)
        with self._lock:
            if self._threads is None:
                if self._closed.is_set():
                    raise ServerUnavailable(f"{self._server}: closed", asked=False)
                self._threads = IOThreads(_CALL_THREADS, f"{self._thread_name}-call")
            threads = self._threads
        try:
            return threads.submit(work)
        except RuntimeError:  # shut down by close() meanwhile
            raise ServerUnavailable(f"{self._server}: closed", asked=False) from None

    def wait(
        self,
        what: str,
        future: concurrent.futures.Future[_T],
        deadline: float,
        setting: str,
    ) -> _T:
        """The result of a call `begin` started, waited for until `deadline` (monotonic)."""
        concurrent.futures.wait([future], timeout=max(0.0, deadline - time.monotonic()))
        if not future.done():
            future.cancel()
            reason = f"no answer within {setting}"
            self.failed(what, reason)
            raise ServerUnavailable(f"{self._server}: {what}: {reason}", asked=True)
        try:
            result = future.result()
        except concurrent.futures.CancelledError:  # close() dropped it before it ran
            raise ServerUnavailable(f"{self._server}: closed", asked=False) from None
        except self._errors as error:
            reason = self._describe(error)
            self.failed(what, reason)
            raise ServerUnavailable(f"{self._server}: {what}: {reason}", asked=True) from None
        self.succeeded()
        return result

    # ------------------------------------------------------------ state

    def failed(self, what: str, error: str) -> None:
        """A call could not reach the server: the outage starts (or goes on)."""
        with self._lock:
            newly_down = not self._down
            self._down = True
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(
                    target=self._probe_until_back, name=f"{self._thread_name}-probe", daemon=True
                )
                self._prober.start()
        self.warn(
            f"{self._server} is unavailable ({what}: {error}): {self._while_down} until it "
            f"is back; probing it every {self._retry_interval_s:g}s",
            force=newly_down,
        )

    def succeeded(self) -> None:
        """A call reached the server: any outage is over."""
        if self._down:
            self._end_outage()

    def warn(self, message: str, *, force: bool = False) -> None:
        """Log `message` unless another warning went out less than the interval ago."""
        now = time.monotonic()
        with self._lock:
            if not force and now < self._next_warning_at:
                self._suppressed_warnings += 1
                return
            suppressed, self._suppressed_warnings = self._suppressed_warnings, 0
            self._next_warning_at = now + self._warning_interval_s
        if suppressed:
            message += f" ({suppressed} similar warnings suppressed)"
        self._logger.warning(message)

    def close(self) -> None:
        """Stop probing and drop the call threads (the caller is being closed)."""
        self._closed.set()
        with self._lock:
            threads, self._threads = self._threads, None
        if threads is not None:
            # Waits for no call: one still on a hung server ends at its timeout.
            threads.shutdown()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=_PROBER_JOIN_S)

    def _probe_until_back(self) -> None:
        while not self._closed.wait(self._retry_interval_s):
            try:
                self._probe()
            except self._errors:
                continue
            except Exception:
                self._logger.exception("%s: reconnect probe failed unexpectedly", self._server)
                continue
            self._end_outage(from_prober=True)
            return
        with self._lock:
            self._prober = None

    def _end_outage(self, *, from_prober: bool = False) -> None:
        with self._lock:
            if from_prober:
                # Cleared under the lock: a failure from now on starts a new prober.
                self._prober = None
            if not self._down:
                return
            self._down = False
            self._suppressed_warnings = 0
        self._logger.warning("%s is reachable again; reconnected", self._server)
