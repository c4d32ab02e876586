"""Admission: a block is saved only once it was seen `threshold` times.

Most prompts are never sent again; saving each of their blocks costs a copy
and, in a full cache, evicts a block that would have been reused. A
`kvwire.media.admission.SaveAdmission` counts how often each
block hash was offered for a save and admits it from its `threshold`-th
sighting on.

The counts live in a count-min sketch (`depth` rows of `width` one-byte
counters; a hash's count is the least of its counters), so the memory is
`depth * width` bytes however many distinct blocks go by: a bounded dict
would have to drop counts of blocks still being counted, a sketch only
overstates some counts (two hashes sharing counters), which admits a block
early, never refuses one seen often enough. Every `width` sightings all
counters are halved, so a block seen many times long ago does not stay
admitted for ever, and the halving costs O(1) amortized per sighting. No
more sightings than counters per row between two halvings keeps the
overstatement rare: with four rows, a block seen once is admitted by mistake
about one time in twenty when every sighting in the window was of a distinct
block, less often when blocks repeat.
"""

from __future__ import annotations

import hashlib

from kvwire.interface.types import BlockHash

__all__ = ["SaveAdmission"]

_MAX_COUNT = 255
# Each byte value to its half: the halving of a row, in C.
_HALVED = bytes(value >> 1 for value in range(256))


class SaveAdmission:
    """Admits a block hash from its `threshold`-th sighting; `threshold` 1 admits every block.

    `width` (a power of two) is the counters per row, and the sightings
    counted between two halvings.
    """

    DEPTH = 4
    """Rows of the sketch: `admit` is written out for exactly these four."""

    def __init__(self, threshold: int, width: int = 1 << 16) -> None:
        if threshold < 1:
            raise ValueError(f"an admission threshold is >= 1, got {threshold}")
        if width < 1 or width & (width - 1):
            raise ValueError(f"the sketch width is a power of two, got {width}")
        self.threshold = threshold
        self.width = width
        self._mask = width - 1
        self._rows = tuple(bytearray(width) for _ in range(self.DEPTH))
        self._sightings = 0
        self._halve_every = width

    @property
    def memory_bytes(self) -> int:
        """The bytes the counters take: fixed at construction."""
        return self.DEPTH * self.width

    def admit(self, block_hash: BlockHash, group: int = 0) -> bool:
        """Count one sighting of `group`'s `block_hash`; whether it is now seen `threshold` times.

        Each KV cache group's entry for a hash is counted on its own, as it is saved on its own.
        """
        if self.threshold == 1:
            return True
        # The scheduler's hot path, once per block offered: `_positions` and a
        # conservative update (only the counters at the least grow, so hashes
        # sharing the others are overstated less) written out for four rows.
        first, second = self._hashes(block_hash, group)
        mask = self._mask
        at0, at1, at2, at3 = (
            first & mask,
            (first + second) & mask,
            (first + 2 * second) & mask,
            (first + 3 * second) & mask,
        )
        row0, row1, row2, row3 = self._rows
        least = min(row0[at0], row1[at1], row2[at2], row3[at3])
        if least < _MAX_COUNT:
            if row0[at0] == least:
                row0[at0] = least + 1
            if row1[at1] == least:
                row1[at1] = least + 1
            if row2[at2] == least:
                row2[at2] = least + 1
            if row3[at3] == least:
                row3[at3] = least + 1
            least += 1
        self._sightings += 1
        if self._sightings >= self._halve_every:
            self._halve()
        return least >= self.threshold

    def count(self, block_hash: BlockHash, group: int = 0) -> int:
        """The sightings counted now: never fewer than there were since the last halving."""
        positions = self._positions(block_hash, group)
        return min(row[i] for row, i in zip(self._rows, positions, strict=True))

    def _positions(self, block_hash: BlockHash, group: int) -> list[int]:
        first, second = self._hashes(block_hash, group)
        return [(first + k * second) & self._mask for k in range(self.DEPTH)]

    @staticmethod
    def _hashes(block_hash: BlockHash, group: int) -> tuple[int, int]:
        """The two hashes each row's position is made of (double hashing)."""
        # Block hashes may be short (tests, plug-ins): mixed first, whatever they are.
        digest = hashlib.blake2b(block_hash, digest_size=16).digest()
        first = int.from_bytes(digest[:8], "little") ^ (group * 0x9E3779B97F4A7C15)
        return first, int.from_bytes(digest[8:], "little") | 1

    def _halve(self) -> None:
        self._sightings = 0
        for row in self._rows:
            row[:] = row.translate(_HALVED)
