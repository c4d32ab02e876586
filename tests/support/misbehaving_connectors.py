"""Connectors that break rules, each named after how.

The interface's rules (for the engine's tests), and a hybrid model's: built-in
connectors with one HMA bug each, for the conformance kit to catch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import attrs

from kvwire.blocks.groups import NULL_BLOCK_ID, CacheGroup
from kvwire.blocks.transfers import BlockTransfer
from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.connectors.offload._planner import BlockPlanner
from kvwire.connectors.offload.scheduler import OffloadSchedulerHalf
from kvwire.interface.base import KVConnectorRole, SupportsHMA
from kvwire.interface.types import ForwardContext, Request, SchedulerOutput
from kvwire.media.base import Medium, MediumContext
from kvwire.media.store.directory import DirectoryMedium
from tests.support.directory_connectors import DirectoryConnector

# Connectors that break the interface's rules (and one HMA variant), for the engine's tests.


class NegativeCountConnector(DirectoryConnector):
    """Answers a negative number of matched tokens."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return -4, False


class AsyncZeroConnector(DirectoryConnector):
    """Claims an asynchronous load of zero tokens."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, True


class NeverReceivesConnector(DirectoryConnector):
    """Starts asynchronous loads and never reports them finished."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None


class RoleMixingConnector(DirectoryConnector):
    """Its scheduler side peeks at worker-side state by calling a worker-side method."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.start_load_kv(ForwardContext(layer_names=()))
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class SilentlyCorruptingConnector(DirectoryConnector):
    """Loads every block, then perturbs it and reports nothing: garbage in the cache."""

    def _load(self, transfers: list[BlockTransfer]) -> list[int]:
        failed = super()._load(transfers)
        for transfer in transfers:
            for cache in self._kv_caches:
                cache[:, transfer.block_id] += 0.5
        return failed


class FailingShutdownConnector(DirectoryConnector):
    """Its worker side's shutdown raises."""

    def shutdown(self) -> None:
        super().shutdown()
        if self.role is KVConnectorRole.WORKER:
            raise RuntimeError("the connector's shutdown broke")


class HMADirectoryConnector(DirectoryConnector, SupportsHMA):
    """A well-behaved HMA-capable connector: finishing goes through the all-groups call."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        kept, _params = self.request_finished(request, block_ids[0])
        return kept, {"groups": len(block_ids)}


class HangingSaveConnector(DirectoryConnector):
    """Its worker side's ``wait_for_save`` never returns (a connector stuck on a dead medium)."""

    def wait_for_save(self) -> None:
        threading.Event().wait(600)  # far past any reply deadline of a test


class RankOneFailingConnector(DirectoryConnector):
    """Its worker side on rank 1 (of a parallel engine) raises as the first step starts."""

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._vllm_config.parallel_config.rank == 1:
            raise RuntimeError("rank 1's connector broke")
        super().start_load_kv(forward_context, **kwargs)


# Built-in connectors with one hybrid-model bug each, for the kit to catch.
#
# Each is a real connector with one rule of serving several KV cache groups
# broken, as a connector author could break it.


class EveryBlockCPUOffloadConnector(CPUOffloadConnector):
    """Saves every block of a sliding-window group, not only those inside its window."""

    window_aware_saves = False


class _WindowOnlyPlanner(BlockPlanner):
    """Saves only the window of a sliding-window group at each step's end, not the block before."""

    def __init__(self, block_size: int, groups: Sequence[CacheGroup], **roles: bool) -> None:
        super().__init__(block_size, groups, **roles)
        self._window_blocks = {group.index: group.window_blocks for group in groups}

    def plan_saves(self, scheduler_output: SchedulerOutput) -> list[BlockTransfer]:
        # A sliding group's range ends at the step's end, and is at most the
        # window and one block long: its last window_blocks are the window.
        ranges = []
        for save in super().plan_saves(scheduler_output):
            window_blocks = self._window_blocks[save.group]
            if window_blocks is not None:
                save = attrs.evolve(
                    save,
                    block_ids=save.block_ids[-window_blocks:],
                    block_hashes=save.block_hashes[-window_blocks:],
                )
            ranges.append(save)
        return ranges


class WindowOnlyCPUOffloadConnector(CPUOffloadConnector):
    """Saves a sliding-window group's window at the end of each step's prefix, but not the
    block before it: a prompt equal to a saved prompt of whole blocks recomputes its last
    token, so its hit ends a block earlier, where the window is missing a block.
    """

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        medium: Medium,
    ) -> None:
        super().__init__(config, role, kv_cache_config, medium=medium)
        if role is not KVConnectorRole.SCHEDULER:
            return
        # The scheduler half again, over the same index, with the bad planner.
        half = self._scheduler_half("WindowOnlyCPUOffloadConnector.__init__")
        transfer = self.kv_transfer_config
        groups = self.medium.context.groups
        planner = _WindowOnlyPlanner(
            self.layout.block_size,
            groups,
            loads=transfer.is_kv_consumer,
            saves=transfer.is_kv_producer,
        )
        async_load = self.medium.context.options["async_load"]
        self._set_scheduler_half(
            OffloadSchedulerHalf(
                index=half.index, planner=planner, num_groups=len(groups), async_load=async_load
            )
        )


class GroupBlindDirectory(DirectoryMedium):
    """Names every group's entry for a block hash alike, so one group loads another's bytes."""

    def __init__(self, context: MediumContext) -> None:
        super().__init__(context)
        # The layouts that name and head entries, without the group in their fingerprint.
        self._group_layouts = tuple(self.layout for _ in context.groups)


class GroupBlindSharedStorageConnector(SharedStorageConnector):
    """Shared storage over the :class:`GroupBlindDirectory` medium."""

    default_medium = f"{__name__}:{GroupBlindDirectory.__name__}"


class NullBlockWritingCPUOffloadConnector(CPUOffloadConnector):
    """Writes KV into the null block (id 0) as each layer loads, as a loader copying every
    position of a sliding-window group would.

    Attention never reads the positions the null block stands for, so outputs stay
    equal: only the KV itself shows it.
    """

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._caches = kv_caches

    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        cache = self._caches[layer_name]
        cache[:, NULL_BLOCK_ID] = cache[:, NULL_BLOCK_ID + 1]
