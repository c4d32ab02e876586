"""The CPU pool medium's memory: preallocated entry slots, reused.

A slot holds one whole entry (the 128-byte header, then the cross-layer
payload), seen both as one `memoryview` and, for copies to and from the
paged cache, as a typed tensor. The memory is allocated and committed once,
when the worker half registers the caches; which slot holds which block is
the scheduler half's business (`kvwire.media.cpu_pool._slot_table`).
The store connectors need no such buffers: they move blocks straight
between the cache and the medium (`kvwire.blocks.memory`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.blocks.format import HEADER_SIZE, BlockLayout
from kvwire.config.dtypes import DTYPES


class PoolSlots:
    """`num_slots` entry-sized buffers in one allocation."""

    def __init__(self, layout: BlockLayout, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the CPU pool needs at least one slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        entry_bytes = layout.entry_bytes
        # One allocation that both Python (memoryviews, for headers) and torch
        # (typed views, for cache copies) see, without numpy in between.
        self._memory = bytearray(num_slots * entry_bytes)
        self._raw = torch.frombuffer(self._memory, dtype=torch.uint8).view(num_slots, entry_bytes)
        # Written now, so every page is committed here and not on the hot path
        # the first time a slot is used.
        self._raw.zero_()
        whole = memoryview(self._memory)
        self._views = [whole[i * entry_bytes : (i + 1) * entry_bytes] for i in range(num_slots)]
        payload = self._raw[:, HEADER_SIZE:].view(DTYPES[layout.dtype].torch_dtype())
        self._payloads = payload.view(num_slots, *layout.shape)

    @property
    def memory(self) -> torch.Tensor:
        """The whole allocation, `[num_slots, entry_bytes]` bytes (to register for RDMA)."""
        return self._raw

    def entry(self, slot: int) -> memoryview:
        """The whole entry (header and payload) of `slot`."""
        return self._views[slot]

    @property
    def payloads(self) -> torch.Tensor:
        """Every slot's payload: `[num_slots, num_layers, 2, block_size, heads, head_size]`."""
        return self._payloads

    def clear_headers(self, slots: Sequence[int]) -> None:
        """Zero these slots' headers: until rewritten, they name no block."""
        if not slots:
            return
        self._raw[_index(slots), :HEADER_SIZE] = 0

    def set_headers(self, slots: Sequence[int], headers: bytearray) -> None:
        """Write `headers` (`HEADER_SIZE` bytes per slot, in order) into these slots."""
        if not slots:
            return
        rows = torch.frombuffer(headers, dtype=torch.uint8).view(len(slots), HEADER_SIZE)
        self._raw[_index(slots), :HEADER_SIZE] = rows

    def headers(self, slots: Sequence[int]) -> bytearray:
        """These slots' headers, one after the other."""
        if not slots:
            return bytearray()
        copied = bytearray(len(slots) * HEADER_SIZE)
        rows = torch.frombuffer(copied, dtype=torch.uint8).view(len(slots), HEADER_SIZE)
        rows.copy_(self._raw[_index(slots), :HEADER_SIZE])
        return copied

    def copy_entries(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy each source slot's whole entry (header and payload) into its target slot."""
        raw = self._raw
        for source, target in zip(sources, targets, strict=True):
            raw[target].copy_(raw[source])

    def payload(self, slot: int) -> torch.Tensor:
        """The payload of `slot` as a cross-layer tensor."""
        return self._payloads[slot]


def _index(slots: Sequence[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.long)
