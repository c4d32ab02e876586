"""Preallocated, reused entry slots: the CPU-offload connector's pool.

A slot holds one whole entry (the 128-byte header, then the cross-layer
payload), seen both as one ``memoryview`` and, for copies to and from the
paged cache, as a typed tensor. (The store connectors need no staging: they
move blocks straight between the cache and the medium, see
:mod:`kvwire.connectors.block_memory`.) The buffers are allocated once, when the worker side
registers the caches; the hot path only takes and returns slot numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvwire.connectors.block_format import HEADER_SIZE, BlockLayout
from kvwire.dtypes import DTYPES


class StagingBuffers:
    """``num_slots`` entry-sized buffers and a free list that callers wait on.

    Only the thread that drives the forward pass takes slots (``acquire``);
    background threads only give them back (``release``). A background job
    therefore never waits for a slot, which rules out deadlocks between jobs.
    """

    def __init__(self, layout: BlockLayout, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"staging buffers need at least one slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        entry_bytes = layout.entry_bytes
        # One allocation that both Python (memoryviews, for stores) and torch
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
        # Kept sorted, and handed out lowest first: slots taken together are
        # then mostly consecutive, and a copy between consecutive blocks and
        # consecutive slots is one copy per layer instead of one per block.
        # Freed in completion order instead, a 128 MiB save of 256 KiB blocks
        # spent 25 ms in its copies out of the cache, against 15-19 ms sorted.
        self._free: list[int] = list(range(num_slots))
        self._available = threading.Condition()

    def entry(self, slot: int) -> memoryview:
        """The whole entry (header and payload) of ``slot``."""
        return self._views[slot]

    @property
    def payloads(self) -> torch.Tensor:
        """Every slot's payload: ``[num_slots, num_layers, 2, block_size, heads, head_size]``."""
        return self._payloads

    def payload(self, slot: int) -> torch.Tensor:
        """The payload of ``slot`` as a cross-layer tensor."""
        return self._payloads[slot]

    def acquire(self, count: int, timeout_s: float) -> list[int]:
        """Take up to ``count`` slots, waiting up to ``timeout_s`` while none is free.

        At least one slot, or none once ``timeout_s`` ran out: slots held by a
        background job that never ends must not hang the caller.
        """
        with self._available:
            self._available.wait_for(lambda: self._free, max(0.0, timeout_s))
            return self._take(count)

    def try_acquire(self, count: int) -> list[int]:
        """Take up to ``count`` free slots without waiting (possibly none)."""
        with self._available:
            return self._take(count)

    def _take(self, count: int) -> list[int]:
        taken = self._free[:count]
        del self._free[:count]
        return taken

    def release(self, slots: Sequence[int]) -> None:
        with self._available:
            self._free.extend(slots)
            # Mostly two sorted runs, which a sort merges in linear time.
            self._free.sort()
            self._available.notify_all()

    @property
    def num_free(self) -> int:
        with self._available:
            return len(self._free)
