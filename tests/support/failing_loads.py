"""A medium that holds its blocks and fails every load of them: a store too slow for its deadline.

Lookups hit (the directory medium's index), every load of every request
fails at its first block; the engine must compute each request, never try
the same load forever, and stop trying the medium for a while.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvwire.interface.counters import Counters
from kvwire.media.store.directory import DirectoryMedium
from kvwire.testing.faulty_medium import FaultInjectingHandler, FaultInjectingMedium, LoadFaults

if TYPE_CHECKING:
    import torch


class EveryLoadFaults(LoadFaults):
    """Every load fails at its first block, not just each request's first one."""

    def choose(self, request_id: str, blocks: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        return blocks[0] if blocks else None


class FailEveryLoad(FaultInjectingMedium):
    """The directory medium, whose every load fails at its first block."""

    inner = DirectoryMedium

    def build_handler(
        self, kv_caches: Mapping[str, torch.Tensor], counters: Counters
    ) -> FaultInjectingHandler:
        from kvwire.blocks.memory import group_memories

        memories = group_memories(kv_caches, self.context.layout, self.context.groups)
        return FaultInjectingHandler(
            self.inner_medium.build_handler(kv_caches, counters),
            memories,
            EveryLoadFaults(None, 0),
        )
