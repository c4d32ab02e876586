"""A connector module whose import takes long: it writes the file ``KVWIRE_TEST_READY`` names,
then waits, so that a test can press Ctrl-C (send SIGINT) while kvwire imports it."""

import os
import pathlib
import time

pathlib.Path(os.environ["KVWIRE_TEST_READY"]).write_text("importing")
_deadline = time.monotonic() + 60.0
while time.monotonic() < _deadline:
    time.sleep(0.05)
