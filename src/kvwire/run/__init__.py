"""``kvwire run``: the command that measures what a connector buys, apart from the engine core.

:mod:`kvwire.cli` calls :func:`configure_parser` and :func:`run` (both in
:mod:`~kvwire.run.command`); :mod:`~kvwire.run.passes` runs the workload on
the engine four ways and :mod:`~kvwire.run.report` prints their table.
Importing this package does not import torch: ``kvwire --help`` must stay fast.
"""

from __future__ import annotations

from kvwire.run.command import configure_parser, main, run

__all__ = ["configure_parser", "main", "run"]
