"""Lookups of a slow medium on a lookup thread, so the scheduler's thread never waits for them.

With `async_lookup`, the first `get_num_new_matched_tokens` of a request
starts the planner's questions for it (`BlockPlanner.probe`) on one of
`LOOKUP_THREADS` threads, against the medium's index, and answers None
("ask again later", vLLM's contract). A later call answers once the thread
has: the planner then looks the request up again on the scheduler's thread,
each question answered from what the thread recorded for the same hashes;
a question the thread did not ask (the engine's local hit grew meanwhile)
counts as a miss. A lookup not answered `lookup_deadline_s` after it
started is a miss: the request computes its blocks itself.

Memory is bounded: at most `MAX_LOOKUPS_IN_FLIGHT` requests have a lookup
pending (a request beyond them is a miss at once), a pending lookup not
started yet is cancelled at its deadline, and a request's entry goes when
its answer is used, at its deadline, or when the request finishes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import attrs

from kvwire.common.redaction import shown
from kvwire.connectors.offload._planner import HitCounter, LookupSpan
from kvwire.interface.types import BlockHash

__all__ = ["AsyncLookups", "LookupAnswers"]

logger = logging.getLogger(__name__)

LOOKUP_THREADS = 4
"""Threads per scheduler half running lookups: a few round trips to one server at once."""

MAX_LOOKUPS_IN_FLIGHT = 1024
"""Requests with a lookup pending, at most; one more is a miss at once (`lookups_late`)."""

_Question = tuple[int, tuple[BlockHash, ...]]


@attrs.frozen
class LookupAnswers:
    """What a lookup thread's index answered, by question: a group and its hashes."""

    answers: Mapping[_Question, int]

    def count(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        """The recorded answer to this question; 0 (a miss) for one the thread did not ask."""
        return self.answers.get((group, tuple(block_hashes)), 0)


@attrs.define
class _Pending:
    started: float
    future: concurrent.futures.Future[LookupAnswers]


class AsyncLookups:
    """The lookups of one scheduler half in flight, by request id (see the module docstring).

    `probe(span, count)` asks `count` the questions a lookup of `span`
    asks; `count_held` answers one question from the medium, on a lookup
    thread. `clock` is `time.monotonic` (a test passes its own).
    """

    def __init__(
        self,
        probe: Callable[[LookupSpan, HitCounter], object],
        count_held: HitCounter,
        *,
        deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_in_flight: int = MAX_LOOKUPS_IN_FLIGHT,
    ) -> None:
        self._probe = probe
        self._count_held = count_held
        self._deadline_s = deadline_s
        self._clock = clock
        self._max_in_flight = max_in_flight
        self._executor = concurrent.futures.ThreadPoolExecutor(
            LOOKUP_THREADS, thread_name_prefix="kvwire-lookup"
        )
        self._pending: dict[str, _Pending] = {}
        self._started = 0
        self._settled = 0
        self._late = 0

    @property
    def in_flight(self) -> int:
        """Requests whose lookup is pending."""
        return len(self._pending)

    def answers(self, request_id: str, span: LookupSpan) -> LookupAnswers | None:
        """The answers for `request_id`'s lookup; None while it runs (its first call starts it).

        Past the deadline, or with `MAX_LOOKUPS_IN_FLIGHT` lookups pending,
        the answers are empty: every question is a miss.
        """
        pending = self._pending.get(request_id)
        if pending is None:
            if len(self._pending) >= self._max_in_flight:
                self._late += 1
                return LookupAnswers({})
            self._pending[request_id] = _Pending(
                self._clock(), self._executor.submit(self._ask, span)
            )
            self._started += 1
            return None
        if pending.future.done():
            del self._pending[request_id]
            self._settled += 1
            if pending.future.exception() is not None:
                # The index's own errors are misses already (`count_held`); this
                # is the planner's, and the request still computes its blocks.
                logger.warning(
                    "lookup of request %s raised %s; counted as a miss",
                    shown(request_id),
                    type(pending.future.exception()).__name__,
                )
                return LookupAnswers({})
            return pending.future.result()
        if self._clock() - pending.started < self._deadline_s:
            return None
        del self._pending[request_id]
        # Not started yet: it never will be. Started: its answer is dropped.
        pending.future.cancel()
        self._settled += 1
        self._late += 1
        return LookupAnswers({})

    def _ask(self, span: LookupSpan) -> LookupAnswers:
        """On a lookup thread: the questions of `span`, asked of the medium and recorded."""
        answers: dict[_Question, int] = {}

        def count(group: int, block_hashes: Sequence[BlockHash]) -> int:
            held = self._count_held(group, block_hashes)
            answers[group, tuple(block_hashes)] = held
            return held

        self._probe(span, count)
        return LookupAnswers(answers)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's lookup; one not started yet never starts."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.future.cancel()
            self._settled += 1

    def take_counters(self) -> dict[str, int]:
        """`lookups_started`, `lookups_settled` and `lookups_late` since the last call, then zero.

        Started less settled, summed over the connector's life, is the
        number of lookups in flight.
        """
        counters = {
            "lookups_started": self._started,
            "lookups_settled": self._settled,
            "lookups_late": self._late,
        }
        self._started = self._settled = self._late = 0
        return counters

    def close(self) -> None:
        """Stop the lookup threads; lookups not started never start."""
        self._pending.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
