"""Test connectors that really move KV blocks through files in a directory.

One for a whole KV cache, and one per KV cache group, which a hybrid engine's
loads go through.
"""

from __future__ import annotations

import os
import pathlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.interface.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole, SupportsHMA
from kvwire.interface.types import (
    BlockHash,
    ForwardContext,
    KVCacheBlocks,
    KVConnectorStats,
    Request,
    SchedulerOutput,
)

# A test connector that really moves KV blocks through files in a directory.
#
# The directory is the shared medium, so the scheduler-role and worker-role
# instances (possibly in different processes) agree on what is stored without
# sharing any Python object. Options in ``kv_connector_extra_config`` turn on
# the behaviours the engine must handle:
#
# - ``load_async``: loads run on a thread and are reported through ``get_finished``;
# - ``answer_none_first``: the first lookup of each request answers None ("ask again");
# - ``fail_loads``: every load leaves its last block unwritten and reports it failed;
# - ``keep_blocks_until_sent``: ``request_finished`` returns True; the worker
#   reports the request finished sending a step later.

_FLAGS = ("load_async", "answer_none_first", "fail_loads", "keep_blocks_until_sent")


@attrs.frozen
class BlockTransfer:
    """One block to move: its place in the paged cache and its file name."""

    block_id: int
    block_hash: BlockHash


@attrs.define
class DirectoryConnectorMetadata(KVConnectorMetadata):
    """This step's loads and saves, per request."""

    loads: dict[str, list[BlockTransfer]] = attrs.field(factory=dict)
    saves: list[BlockTransfer] = attrs.field(factory=list)
    async_loads: bool = False


def _settings(config: EngineConfig) -> tuple[pathlib.Path, dict[str, bool]]:
    assert config.kv_transfer_config is not None
    extra = dict(config.kv_transfer_config.kv_connector_extra_config)
    unknown = set(extra) - {"store_dir", *_FLAGS}
    if unknown:
        raise ValueError(
            f"kv_connector_extra_config.{sorted(unknown)[0]}: unknown key; "
            f"accepted keys are store_dir, {', '.join(_FLAGS)}"
        )
    if not isinstance(extra.get("store_dir"), str):
        raise ValueError("kv_connector_extra_config.store_dir: a directory path (str) is required")
    flags = {}
    for flag in _FLAGS:
        value = extra.get(flag, False)
        if not isinstance(value, bool):
            raise ValueError(
                f"kv_connector_extra_config.{flag}: expected true or false, got {value!r}"
            )
        flags[flag] = value
    return pathlib.Path(extra["store_dir"]), flags


class DirectoryConnector(KVConnectorBase):
    """Stores every full block as one file named by its chained hash."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.store_dir, self.flags = _settings(config)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.block_size = config.cache_config.block_size
        # scheduler side
        self._asked: set[str] = set()
        self._lookup_start: dict[str, int] = {}
        self._requests: dict[str, Request] = {}
        self._saved_blocks: dict[str, int] = {}
        self._pending_loads: dict[str, list[BlockTransfer]] = {}
        # worker side
        self._kv_caches: list[torch.Tensor] = []
        self._executor: ThreadPoolExecutor | None = None
        self._loading: dict[str, Future[list[int]]] = {}
        self._failed_blocks: set[int] = set()
        self._sending: set[str] = set()
        self._stats: dict[str, float] = {}

    def _path(self, block_hash: BlockHash) -> pathlib.Path:
        return self.store_dir / block_hash.hex()

    def _is_stored(self, block_hash: BlockHash) -> bool:
        """Whether a lookup may claim ``block_hash``'s block (a subclass storing more overrides)."""
        return self._path(block_hash).exists()

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.flags["answer_none_first"] and request.request_id not in self._asked:
            self._asked.add(request.request_id)
            return None, False
        self._lookup_start[request.request_id] = num_computed_tokens
        first = num_computed_tokens // self.block_size
        hits = 0
        for block_hash in request.block_hashes[first:]:
            if not self._is_stored(block_hash):
                break
            hits += 1
        tokens = max(0, (first + hits) * self.block_size - num_computed_tokens)
        return tokens, tokens > 0 and self.flags["load_async"]

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._requests[request.request_id] = request
        block_ids = blocks.get_block_ids()[0]
        if num_external_tokens == 0:
            return
        # The request's own count is not updated yet: the lookup's start is what counts.
        first_external = self._lookup_start[request.request_id] // self.block_size
        last = first_external + num_external_tokens // self.block_size
        self._pending_loads[request.request_id] = [
            BlockTransfer(block_ids[index], request.block_hashes[index])
            for index in range(first_external, last)
        ]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = DirectoryConnectorMetadata(
            loads=self._pending_loads, async_loads=self.flags["load_async"]
        )
        self._pending_loads = {}
        for item in scheduler_output.scheduled:
            request = self._requests[item.request_id]
            computed = item.num_computed_tokens + item.num_scheduled_tokens
            start = self._saved_blocks.get(item.request_id, 0)
            full = min(computed // self.block_size, len(request.block_hashes))
            for index in range(start, full):
                metadata.saves.append(
                    BlockTransfer(item.block_ids[0][index], request.block_hashes[index])
                )
            self._saved_blocks[item.request_id] = max(start, full)
        for request_id in scheduler_output.preempted_req_ids:
            self._saved_blocks.pop(request_id, None)
        return metadata

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._saved_blocks.pop(request.request_id, None)
        if self.flags["keep_blocks_until_sent"]:
            return True, {"stored_in": str(self.store_dir)}
        return False, None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = [kv_caches[name] for name in self.kv_cache_config.layer_names]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, DirectoryConnectorMetadata)
        for request_id, transfers in metadata.loads.items():
            if metadata.async_loads:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1)
                self._loading[request_id] = self._executor.submit(self._load, transfers)
            else:
                self._failed_blocks.update(self._load(transfers))

    def _load(self, transfers: list[BlockTransfer]) -> list[int]:
        started = time.perf_counter()
        failed = []
        for position, transfer in enumerate(transfers):
            if self.flags["fail_loads"] and position == len(transfers) - 1:
                failed.append(transfer.block_id)
                continue
            stored = torch.load(self._path(transfer.block_hash))
            for layer, cache in enumerate(self._kv_caches):
                cache[:, transfer.block_id].copy_(stored[layer])
            self._count("blocks_loaded", 1)
            self._count("bytes_loaded", stored.numel() * stored.element_size())
        self._count("load_seconds", time.perf_counter() - started)
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, DirectoryConnectorMetadata)
        started = time.perf_counter()
        for transfer in metadata.saves:
            path = self._path(transfer.block_hash)
            if path.exists():
                continue
            block = torch.stack([cache[:, transfer.block_id] for cache in self._kv_caches])
            partial = path.with_suffix(f".{os.getpid()}.partial")
            torch.save(block.clone(), partial)
            partial.replace(path)
            self._count("blocks_saved", 1)
            self._count("bytes_saved", block.numel() * block.element_size())
        if metadata.saves:
            self._count("save_seconds", time.perf_counter() - started)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        received = {rid for rid, future in self._loading.items() if future.done()}
        for request_id in received:
            self._failed_blocks.update(self._loading.pop(request_id).result())
        sent = self._sending
        self._sending = set(finished_req_ids) if self.flags["keep_blocks_until_sent"] else set()
        return (sent or None), (received or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self._stats:
            return None
        stats, self._stats = KVConnectorStats(data=dict(self._stats)), {}
        return stats

    def _count(self, name: str, amount: float) -> None:
        self._stats[name] = self._stats.get(name, 0) + amount

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


# The directory test connector, per KV cache group: what a hybrid engine's loads go through.
#
# Each group's blocks are files of their own (``g{group}-{hash}``); a group's
# block is read and written with that group's layers only, with that group's
# block id, as an HMA connector must (layers of different groups share their
# tensors). A lookup claims the blocks every group has stored; a sliding-window
# group's null blocks are never loaded nor saved. The flags are the
# directory connector's (``fail_loads`` fails each load's last block: the
# sliding group's).

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
