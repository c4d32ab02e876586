"""A connector module whose import is slow in a worker process only.

In a spawned worker process it writes the file ``KVWIRE_TEST_READY`` names,
then waits, so that a test can press Ctrl-C (send SIGINT) while the worker
starts; in the process that spawned it, it imports at once.
"""

import multiprocessing
import os
import pathlib
import time

from kvwire.testing import IdleConnector


class SlowInWorkerConnector(IdleConnector):
    """A connector that does nothing; what matters is how long its module takes to import."""


if multiprocessing.parent_process() is not None:
    pathlib.Path(os.environ["KVWIRE_TEST_READY"]).write_text("worker importing")
    _deadline = time.monotonic() + 60.0
    while time.monotonic() < _deadline:
        time.sleep(0.05)
