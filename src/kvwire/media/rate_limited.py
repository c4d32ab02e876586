"""Warnings that repeat at most once per interval, so a dead disk or server cannot flood logs."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimitedWarning"]


class RateLimitedWarning:
    """Logs a warning per `reason` at most once every `interval_s`, counting the rest."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, reason: str, message: str, *args: object) -> None:
        """Log `message % args` unless a warning for `reason` was logged within the interval."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last < self._interval_s:
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return
            self._last[reason] = now
            suppressed = self._suppressed.pop(reason, 0)
        if suppressed:
            message += " (%d similar warnings suppressed)"
            args = (*args, suppressed)
        self._logger.warning(message, *args)
