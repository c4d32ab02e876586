"""`kvwire run`: the command that measures what a connector buys, apart from the engine core.

`kvwire.cli` calls `configure_parser` and `run` (both in
`command`); `passes` runs the workload on
the engine four ways and `report` prints their table.
Importing this package does not import torch: `kvwire --help` must stay fast.
"""

from __future__ import annotations

from kvwire.run.command import configure_parser, main, run

__all__ = ["configure_parser", "main", "run"]
