"""The `kvwire` command, run from a script whose import is slow in a spawned worker process.

A spawned process imports its parent's main script again, as ``__mp_main__``,
before any of kvwire's code runs there. In the run's first worker process
this one then writes the file ``KVWIRE_TEST_WORKER_IMPORTING`` names and waits (at most
60 s) for a file of that name with ``-go-on`` appended, so that a test can
send SIGINT while a worker process still imports, and then let it go on.
"""

import os
import pathlib
import sys
import time

if __name__ == "__mp_main__":
    _ready = pathlib.Path(os.environ["KVWIRE_TEST_WORKER_IMPORTING"])
    if not _ready.exists():  # the worker of the run's first pass
        _ready.write_text("worker importing")
        _go_on = _ready.with_name(_ready.name + "-go-on")
        _deadline = time.monotonic() + 60.0
        while not _go_on.exists() and time.monotonic() < _deadline:
            time.sleep(0.05)

if __name__ == "__main__":
    from kvwire.cli import main

    sys.exit(main())
