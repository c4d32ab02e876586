"""The directory test connector, per KV cache group: what a hybrid engine's loads go through.

Each group's blocks are files of their own (``g{group}-{hash}``); a group's
block is read and written with that group's layers only, with that group's
block id, as an HMA connector must (layers of different groups share their
tensors). A lookup claims the blocks every group has stored; a sliding-window
group's null blocks are never loaded nor saved. The flags are the
directory connector's (``fail_loads`` fails each load's last block: the
sliding group's).
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import attrs
import torch

from kvwire.interface.base import KVConnectorMetadata, SupportsHMA
from kvwire.interface.types import BlockHash, KVCacheBlocks, Request, SchedulerOutput
from tests.support.directory_connector import (
    BlockTransfer,
    DirectoryConnector,
    DirectoryConnectorMetadata,
)

_NULL_BLOCK = 0


@attrs.frozen
class GroupTransfer(BlockTransfer):
    """A block of one KV cache group."""

    group: int


class HybridDirectoryConnector(DirectoryConnector, SupportsHMA):
    """Moves each group's blocks separately; claims only prefixes every group stored."""

    _group_caches: list[list[torch.Tensor]]

    def _group_path(self, group: int, block_hash: BlockHash) -> pathlib.Path:
        return self.store_dir / f"g{group}-{block_hash.hex()}"

    @property
    def _num_groups(self) -> int:
        return len(self.kv_cache_config.kv_cache_groups)

    def _is_stored(self, block_hash: BlockHash) -> bool:
        return all(self._group_path(g, block_hash).exists() for g in range(self._num_groups))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens == 0:
            return
        first = self._lookup_start[request.request_id] // self.block_size
        last = first + num_external_tokens // self.block_size
        self._pending_loads[request.request_id] = [
            GroupTransfer(block_ids[index], request.block_hashes[index], group)
            for group, block_ids in enumerate(blocks.get_block_ids())
            for index in range(first, last)
            if block_ids[index] != _NULL_BLOCK
        ]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = DirectoryConnectorMetadata(
            loads=self._pending_loads, async_loads=self.flags["load_async"]
        )
        self._pending_loads = {}
        for item in scheduler_output.scheduled:
            request = self._requests[item.request_id]
            computed = item.num_computed_tokens + item.num_scheduled_tokens
            full = min(computed // self.block_size, len(request.block_hashes))
            start = self._saved_blocks.get(item.request_id, 0)
            for group, block_ids in enumerate(item.block_ids):
                metadata.saves.extend(
                    GroupTransfer(block_ids[index], request.block_hashes[index], group)
                    for index in range(start, full)
                    if block_ids[index] != _NULL_BLOCK
                )
            self._saved_blocks[item.request_id] = max(start, full)
        for request_id in scheduler_output.preempted_req_ids:
            self._saved_blocks.pop(request_id, None)
        return metadata

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._group_caches = [
            [kv_caches[name] for name in group.layer_names]
            for group in self.kv_cache_config.kv_cache_groups
        ]

    def _load(self, transfers: list[BlockTransfer]) -> list[int]:
        started = time.perf_counter()
        failed = []
        for position, transfer in enumerate(transfers):
            assert isinstance(transfer, GroupTransfer)
            if self.flags["fail_loads"] and position == len(transfers) - 1:
                failed.append(transfer.block_id)
                continue
            stored = torch.load(self._group_path(transfer.group, transfer.block_hash))
            for layer, cache in enumerate(self._group_caches[transfer.group]):
                cache[:, transfer.block_id].copy_(stored[layer])
            self._count("bytes_loaded", stored.numel() * stored.element_size())
        self._count("load_seconds", time.perf_counter() - started)
        return failed

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, DirectoryConnectorMetadata)
        for transfer in metadata.saves:
            assert isinstance(transfer, GroupTransfer)
            path = self._group_path(transfer.group, transfer.block_hash)
            if path.exists():
                continue
            caches = self._group_caches[transfer.group]
            block = torch.stack([cache[:, transfer.block_id] for cache in caches])
            partial = path.with_suffix(f".{os.getpid()}.partial")
            torch.save(block.clone(), partial)
            partial.replace(path)
            self._count("bytes_saved", block.numel() * block.element_size())
