"""A connector whose worker half, in its first step, writes the file ``KVWIRE_TEST_READY``
names, then waits (at most 60 s).

So that a test can press Ctrl-C (send SIGINT) while a worker process runs the
engine's steps, not while it starts.
"""

import os
import pathlib
import time
from typing import Any

from kvwire.interface.types import ForwardContext
from kvwire.testing import IdleConnector


class SlowInWorkerStepsConnector(IdleConnector):
    """A connector that does nothing but hold its worker's first step."""

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        ready = pathlib.Path(os.environ["KVWIRE_TEST_READY"])
        if ready.exists():
            return
        ready.write_text("in a step")
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            time.sleep(0.05)
