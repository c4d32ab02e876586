"""Built-in connectors with one hybrid-model bug each, for the kit to catch.

Each is a real connector with one rule of serving several KV cache groups
broken, as a connector author could break it.
"""

from __future__ import annotations

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
from kvwire.interface.base import KVConnectorRole
from kvwire.interface.types import SchedulerOutput
from kvwire.media.base import Medium, MediumContext
from kvwire.media.store.directory import DirectoryMedium


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
