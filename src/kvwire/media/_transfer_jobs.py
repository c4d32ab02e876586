"""Background transfer jobs that their caller may stop waiting for at a deadline.

A worker hands copies and store I/O to thread pools, and the thread that
drives the forward pass waits for them. A job stuck in a store (a server
that never answers, a blocked file) must not hang that thread: past the
job's deadline the caller abandons it and reports its blocks failed. The
job may still be running; it then writes nothing more where the caller
could see it. `BackgroundJob` makes "the job ended" and "the caller
gave up" exclusive, under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

from kvwire.exceptions import JobAbandoned


class BackgroundJob:
    """One background job, its deadline (`time.monotonic()`), and who settled it.

    The job ends itself (`end`) or the caller gives up on it
    (`abandon`); exactly one of them wins. A job writes where the
    caller can see it only under `lock` after `check`, so once
    `abandon` has returned, no such write is under way or starts.
    """

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.lock = threading.Lock()
        self.abandoned = False
        self.ended = False
        self.future: Future[None] | None = None

    def check(self) -> None:
        """Raise [`JobAbandoned`][kvwire.media.JobAbandoned] if the caller gave up; call it holding
        `lock`."""
        if self.abandoned:
            raise JobAbandoned

    def abandon(self) -> bool:
        """Give up on the job unless it has ended; whether it was given up on now.

        Waits at most for a write under way under `lock` (a memory
        copy), never for the job's I/O.
        """
        with self.lock:
            if self.ended or self.abandoned:
                return False
            self.abandoned = True
        # A job still queued never runs; one already running notices the flag.
        if self.future is not None:
            self.future.cancel()
        return True

    def never_ran(self) -> bool:
        """Whether the job was abandoned before it started (its resources are the caller's)."""
        return self.future is not None and self.future.cancelled()

    def end(self) -> bool:
        """Mark the job ended; False if its caller gave up on it first."""
        with self.lock:
            if self.abandoned:
                return False
            self.ended = True
            return True


class BlockJob(BackgroundJob):
    """A job over blocks of the KV cache: the ids it reads or writes, and those that failed.

    `failed` is the job's to set before it ends; once the job was
    given up on, every block of it counts failed instead.
    """

    def __init__(self, deadline: float, block_ids: Sequence[int]) -> None:
        super().__init__(deadline)
        self.block_ids = block_ids
        self.failed: Sequence[int] = ()
