"""A medium index that holds every block it is asked about, and counts the questions."""

from __future__ import annotations

from collections.abc import Sequence

from kvwire.interface.types import BlockHash
from kvwire.media.base import MediumIndex


class IndexHoldingEverything(MediumIndex):
    """Every lookup is a full hit; ``lookups`` counts them, ``corrupt`` collects failed loads."""

    def __init__(self) -> None:
        self.lookups = 0
        self.corrupt: list[BlockHash] = []

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        self.lookups += 1
        return len(block_hashes)

    def complete_load(
        self, group: int, block_hashes: Sequence[BlockHash], corrupt: Sequence[BlockHash]
    ) -> None:
        self.corrupt.extend(corrupt)
