"""`kvwire replay`: how big a CPU pool, which eviction policy, answered from a request trace.

`kvwire.cli` calls `configure_parser` and `run` (both in `command`), only
when `replay` is the command. The library underneath: `trace` reads and
writes the JSONL trace form public production traces use; `pool` replays a
trace through the CPU pool's own index (`replay_pool`); `belady` gives the
offline optimum (`belady_hits`); `sweep` runs every configuration at every
size; `synthetic` generates a trace shaped like serving traffic; `plot` draws
the curves. The tiers benchmark (`benchmarks/tiers.py`) uses the same code.
"""

from __future__ import annotations

from kvwire.replay.command import configure_parser, run

__all__ = ["configure_parser", "run"]
