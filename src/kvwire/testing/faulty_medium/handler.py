"""The fault-injecting medium's worker half: the wrapped medium's handler, whose chosen loads fail.

`LoadFaults` chooses which loads fail (each chosen request's first
one, at one block of its range); `FaultInjectingHandler` fails them
after the wrapped medium's loads ended (see `kvwire.testing.faulty_medium.medium`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING

from kvwire.blocks.transfers import BlockTransfer
from kvwire.interface.types import KVCacheEvent
from kvwire.media.base import JobResult, TransferHandler, TransferJob, TransferKind

if TYPE_CHECKING:
    from kvwire.blocks.memory import BlockMemory

__all__ = ["POISON_BYTE", "FaultInjectingHandler", "LoadFaults", "poison_block"]

POISON_BYTE = 0xFF
"""What a failed load leaves in a block: all bits set, a NaN in every float dtype."""


def poison_block(memory: BlockMemory, block_id: int) -> None:
    """Fill block `block_id` of every layer in `memory` with `POISON_BYTE`."""
    for byte_range in memory.ranges(block_id):
        byte_range[:] = bytes([POISON_BYTE]) * len(byte_range)


class LoadFaults:
    """Which loads fail: each chosen request's first one, at one block of its range.

    Shared by the fault-injecting medium and the conformance kit's
    fault-injecting connector, so both fail the same block.
    """

    def __init__(self, request_ids: frozenset[str] | None, block_index: int) -> None:
        self._request_ids = request_ids
        self._block_index = block_index
        self._failed_requests: set[str] = set()

    def choose(self, request_id: str, blocks: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        """The `(group, block id)` of `blocks` to fail for this load of `request_id`, if any.

        `blocks` is the loaded range, group after group. Only a chosen
        request's first load with blocks fails.
        """
        if (
            not blocks
            or request_id in self._failed_requests
            or (self._request_ids is not None and request_id not in self._request_ids)
        ):
            return None
        self._failed_requests.add(request_id)
        index = max(-len(blocks), min(self._block_index, len(blocks) - 1))
        return blocks[index]


class FaultInjectingHandler(TransferHandler):
    """The wrapped medium's transfer handler, with the chosen loads failed after they end.

    `memories` holds each KV cache group's blocks as byte ranges, in group
    order (`kvwire.blocks.memory.group_memories`).
    """

    def __init__(
        self,
        inner: TransferHandler,
        memories: Sequence[BlockMemory],
        faults: LoadFaults,
    ) -> None:
        self.inner = inner
        self._memories = tuple(memories)
        self._faults = faults
        # The blocks to fail of each load job, once the wrapped job ended.
        self._failures: dict[int, list[tuple[int, int]]] = {}

    def submit(self, job: TransferJob) -> None:
        self.inner.submit(job)
        if job.kind is not TransferKind.LOAD:
            return
        for request_id, blocks in _loaded_ranges(job.transfers).items():
            chosen = self._faults.choose(request_id, blocks)
            if chosen is not None:
                self._failures.setdefault(job.job_id, []).append(chosen)

    def poll(self) -> list[JobResult]:
        results = self.inner.poll()
        for index, result in enumerate(results):
            failures = self._failures.pop(result.job_id, None)
            if failures:
                # Only now: the wrapped load, still running before, would overwrite the garbage.
                for group, block_id in failures:
                    poison_block(self._memories[group], block_id)
                failed = result.failed | {block_id for _, block_id in failures}
                results[index] = JobResult(result.job_id, failed)
        return results

    def wait(self, job_ids: Iterable[int], until: float | None = None) -> bool:
        return self.inner.wait(job_ids, until)

    def release_saves_reading(
        self, request_ids: Iterable[str], block_ids: Set[int]
    ) -> list[BlockTransfer]:
        return self.inner.release_saves_reading(request_ids, block_ids)

    def take_events(self) -> list[KVCacheEvent]:
        return self.inner.take_events()

    def take_counters(self) -> Mapping[str, float]:
        return self.inner.take_counters()

    def close(self) -> None:
        self.inner.close()


def _loaded_ranges(transfers: Sequence[BlockTransfer]) -> dict[str, list[tuple[int, int]]]:
    """Each request's loaded blocks as `(group, block id)`, group after group, in block order."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for transfer in sorted(transfers, key=lambda transfer: transfer.group):
        ranges.setdefault(transfer.request_id, []).extend(
            (transfer.group, block_id) for block_id in transfer.block_ids
        )
    return ranges
