"""When the Redis server is down: answer at once, probe in the background, warn sparingly.

An outage is found by the call that fails. From then on every call answers
at once without touching the network (a miss, a dropped save, a failed
load): a server that is unreachable rather than refusing would otherwise
cost each lookup on the scheduler's thread a connect timeout. A background
thread probes the server every ``retry_interval_s`` and ends the outage as
soon as it answers; the connection pool then reconnects by itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kvwire.media.store.redis._store")


class OutageTracker:
    """Whether the server is considered down; the reconnect probe; rate-limited warnings.

    ``probe`` raises when the server cannot be reached (a ``PING``);
    ``probe_errors`` are the exceptions that mean "still down".
    """

    def __init__(
        self,
        server: str,
        *,
        probe: Callable[[], object],
        probe_errors: tuple[type[BaseException], ...],
        retry_interval_s: float,
        warning_interval_s: float,
    ) -> None:
        self._server = server
        self._probe = probe
        self._probe_errors = probe_errors
        self._retry_interval_s = retry_interval_s
        self._warning_interval_s = warning_interval_s
        self._lock = threading.Lock()
        self._down = False
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self._next_warning_at = 0.0
        self._suppressed_warnings = 0

    @property
    def is_down(self) -> bool:
        return self._down

    def failed(self, what: str, error: str) -> None:
        """A call could not reach the server: the outage starts (or goes on)."""
        with self._lock:
            newly_down = not self._down
            self._down = True
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(
                    target=self._probe_until_back, name="kvwire-redis-reconnect", daemon=True
                )
                self._prober.start()
        self.warn(
            f"Redis at {self._server} is unavailable ({what}: {error}): lookups miss, saves are "
            f"dropped and loads fail until it is back; probing it every "
            f"{self._retry_interval_s:g}s",
            force=newly_down,
        )

    def succeeded(self) -> None:
        """A call reached the server: any outage is over."""
        if self._down:
            self._end_outage()

    def warn(self, message: str, *, force: bool = False) -> None:
        """Log ``message`` unless another warning went out less than the interval ago."""
        now = time.monotonic()
        with self._lock:
            if not force and now < self._next_warning_at:
                self._suppressed_warnings += 1
                return
            suppressed, self._suppressed_warnings = self._suppressed_warnings, 0
            self._next_warning_at = now + self._warning_interval_s
        if suppressed:
            message += f" ({suppressed} similar warnings suppressed)"
        logger.warning(message)

    def close(self) -> None:
        """Stop probing (the store is being closed)."""
        self._closed.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=5)

    def _probe_until_back(self) -> None:
        while not self._closed.wait(self._retry_interval_s):
            try:
                self._probe()
            except self._probe_errors:
                continue
            except Exception:
                logger.exception("Redis reconnect probe failed unexpectedly")
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
        logger.warning("Redis at %s is reachable again; reconnected", self._server)
