"""Run a kvwire command in a process where some of its optional dependencies cannot be imported.

A meta-path finder placed first raises `ModuleNotFoundError(name=...)` for
the blocked top-level modules, as an import does in a venv without the
extra that installs them, whatever this venv has installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

_WRAPPER = """
import sys

BLOCKED = set(sys.argv[1].split(","))


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocker())
from kvwire.cli import main

sys.exit(main(sys.argv[2:]))
"""


def run_kvwire_without(
    blocked: Sequence[str], arguments: Sequence[str], *, cwd: str | os.PathLike[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvwire ARGUMENTS` in a fresh interpreter where `blocked` modules cannot be imported."""
    return subprocess.run(
        [sys.executable, "-c", _WRAPPER, ",".join(blocked), *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )
