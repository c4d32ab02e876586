"""`python -m kvwire.run`: the same as `kvwire run`."""

from __future__ import annotations

import sys

from kvwire.run.command import main

# Guarded: a walk over kvwire's modules (tests/exceptions) imports this one too.
if __name__ == "__main__":
    sys.exit(main())
