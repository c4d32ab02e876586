"""`python -m kvwire`: the `kvwire` command, for an environment whose scripts are not on PATH."""

import sys

from kvwire.cli import main

if __name__ == "__main__":
    sys.exit(main())
