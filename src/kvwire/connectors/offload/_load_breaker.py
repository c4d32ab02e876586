"""When a medium's loads keep failing: offer no hits for a while, then let one load probe it.

A medium can answer lookups and still fail every load: a Redis server that
holds the blocks but cannot send them within `load_timeout_s`, a disk
whose entries all fail their checksum, a peer that vanished. Each such load
costs its request the wait, then the recomputation. After
`failures_to_pause` loads in a row failed, `LoadBreaker` says to
offer no hits for `pause_s`: the lookups answer "miss" at once, without
asking the medium, as `OutageTracker` answers
for a server that is down. Then the next load is a probe: the lookups miss
again until it ends, a sound probe ends the pause, a failed one starts the
next (a load planned before the pause that ends sound ends it too).
Warnings are rate-limited; `LoadBreaker.take_counters` counts the
requests' loads that failed (`loads_failed`), the pauses
(`load_pauses`) and the lookups answered "miss" during them
(`lookups_paused`).

Unlike a server's outage, there is nothing to probe but a load, and loads
are the engine's to schedule: so no probe callable and no thread (which the
outage tracker has), the probe is the next load the engine plans.
Scheduler-side bookkeeping on the engine's scheduling thread: no lock, a
clock read per lookup while paused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvwire.media.rate_limited import RateLimitedWarning

__all__ = ["LoadBreaker"]

logger = logging.getLogger(__name__)

DEFAULT_FAILURES_TO_PAUSE = 5
DEFAULT_PAUSE_S = 10.0


class LoadBreaker:
    """Whether to offer a medium's hits, from how its recent loads ended; not thread-safe.

    `medium` names the medium in warnings; `clock` is monotonic seconds.
    """

    def __init__(
        self,
        medium: str,
        *,
        failures_to_pause: int = DEFAULT_FAILURES_TO_PAUSE,
        pause_s: float = DEFAULT_PAUSE_S,
        clock: Callable[[], float] = time.monotonic,
        warning_interval_s: float = 10.0,
    ) -> None:
        if failures_to_pause < 1 or pause_s <= 0:
            raise ValueError(
                f"LoadBreaker: failures_to_pause must be >= 1 and pause_s > 0, got "
                f"{failures_to_pause} and {pause_s}"
            )
        self._medium = medium
        self._failures_to_pause = failures_to_pause
        self._pause_s = pause_s
        self._clock = clock
        self._warn = RateLimitedWarning(logger, warning_interval_s)
        self._failures_in_a_row = 0
        # None while hits are offered; else when the next probe may start.
        self._paused_until: float | None = None
        # While a probe's load runs: when another probe may start instead
        # (a probe whose end is never reported must not pause hits for good).
        self._probe_until: float | None = None
        self._failed_loads = 0
        self._pauses = 0
        self._missed_lookups = 0

    @property
    def paused(self) -> bool:
        """Whether hits are withheld (a probe not yet due, or one running)."""
        return self._paused_until is not None

    def offers_hits(self) -> bool:
        """Whether a lookup may offer the medium's hits now (counted when not)."""
        if self._paused_until is None:
            return True
        now = self._clock()
        probing = self._probe_until is not None and now < self._probe_until
        if now >= self._paused_until and not probing:
            return True  # the probe: the next load allocated
        self._missed_lookups += 1
        return False

    def load_started(self) -> None:
        """A load was planned; while paused, it is the probe."""
        if self._paused_until is not None:
            self._probe_until = self._clock() + self._pause_s

    def load_ended(self, *, failed: bool) -> None:
        """A request's load ended; `failed` when any of its blocks failed."""
        if not failed:
            self._failures_in_a_row = 0
            if self._paused_until is not None:
                self._paused_until = self._probe_until = None
                logger.warning(
                    "%s: a load succeeded again; its hits are offered again", self._medium
                )
            return
        self._failures_in_a_row += 1
        self._failed_loads += 1
        if self._paused_until is not None:
            if self._probe_until is not None:  # the probe failed: pause again
                self._pause()
            return
        if self._failures_in_a_row >= self._failures_to_pause:
            self._pause()

    def _pause(self) -> None:
        self._paused_until = self._clock() + self._pause_s
        self._probe_until = None
        self._pauses += 1
        self._warn.warn(
            "paused",
            "%s: %d loads in a row failed; its hits are not offered for %gs, then one load "
            "probes it (computing is cheaper than loads that fail)",
            self._medium,
            self._failures_in_a_row,
            self._pause_s,
        )

    def take_counters(self) -> dict[str, int]:
        """Its counts since the last call, then reset: see the module docstring."""
        counters = {
            "loads_failed": self._failed_loads,
            "load_pauses": self._pauses,
            "lookups_paused": self._missed_lookups,
        }
        self._failed_loads = self._pauses = self._missed_lookups = 0
        return counters
