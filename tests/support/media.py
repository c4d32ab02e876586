"""Media for the media's and the engine's tests.

Handlers driven as the offload connector drives them, media whose loads fail,
an index that counts its questions, and CPU pool slots that are mixed up.
"""

from __future__ import annotations

import pathlib
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
from dependency_injector import providers

from kvwire.blocks.transfers import TransferPayload
from kvwire.config import EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy
from kvwire.connectors.offload.transfer_book import TransferBook
from kvwire.container import KVConnectorContainer, container_for_profile
from kvwire.interface.counters import Counters
from kvwire.interface.types import BlockHash
from kvwire.media.base import Medium, MediumIndex, TransferHandler
from kvwire.media.cpu_pool.pool_memory import PoolSlots
from kvwire.media.store.directory import DirectoryMedium
from kvwire.registry import default_registry
from kvwire.testing.faulty_medium import FaultInjectingHandler, FaultInjectingMedium, LoadFaults

# A medium's transfer handler driven as the offload connector drives it, for a medium's own tests.

HandlerT = TypeVar("HandlerT", bound=TransferHandler)


class DrivenHandler(TransferBook, Generic[HandlerT]):
    """``handler`` behind the connector's bookkeeping: loads per step and request, saves, errors.

    ``close`` passes its keywords (a handler's ``timeout_s``) on to the handler.
    """

    handler: HandlerT

    def __init__(self, handler: HandlerT) -> None:
        super().__init__(handler)

    def close(self, **kwargs: Any) -> None:
        self.handler.close(**kwargs)


# Media whose chosen loads fail, and engines over them, for the engine's recovery tests.
#
# Each medium is a :class:`~kvwire.testing.faulty_medium.FaultInjectingMedium` over the
# directory medium, configured by class attributes, so a profile can name it
# (``kv_connector_extra_config.medium: tests.support.media:Class``) for
# a worker process. In process, :func:`over_medium` overrides the registry's
# ``directory`` medium the way a container user overrides a connector.


class FailEveryFirstBlock(FaultInjectingMedium):
    """Every request's first load fails at its first block."""

    inner = DirectoryMedium
    fail_block_index = 0


class FailEverySecondBlock(FaultInjectingMedium):
    """Every request's first load fails at its second block (its only one, if one)."""

    inner = DirectoryMedium
    fail_block_index = 1


class FailEveryLastBlock(FaultInjectingMedium):
    """Every request's first load fails at its last block (on hybrid models, a sliding one)."""

    inner = DirectoryMedium
    fail_block_index = -1


class FailFirstsFirstBlock(FaultInjectingMedium):
    """Request ``first``'s first load fails at its first block."""

    inner = DirectoryMedium
    fail_request_ids = frozenset({"first"})
    fail_block_index = 0


class FailAsLastBlock(FaultInjectingMedium):
    """Request ``A``'s first load fails at its last block."""

    inner = DirectoryMedium
    fail_request_ids = frozenset({"A"})
    fail_block_index = -1


def shared_storage(
    config: EngineConfig,
    path: pathlib.Path,
    policy: LoadFailurePolicy = "recompute",
    role: KVRole = "kv_both",
    **extra: Any,
) -> EngineConfig:
    """``config`` with a SharedStorageConnector over ``path`` (the directory medium)."""
    return attrs.evolve(
        config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="SharedStorageConnector",
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config={"shared_storage_path": str(path), **extra},
        ),
    )


def over_medium(
    config: EngineConfig, medium: type[Medium], name: str = "directory"
) -> KVConnectorContainer:
    """A container for ``config`` whose registry (a private copy) gives ``medium`` for ``name``."""
    registry = default_registry().copy()
    registry.media.provider(name).override(providers.Object(medium))
    return container_for_profile(config, registry=registry)


# A medium that holds its blocks and fails every load of them: a store too slow for its deadline.
#
# Lookups hit (the directory medium's index), every load of every request
# fails at its first block; the engine must compute each request, never try
# the same load forever, and stop trying the medium for a while.

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


# A medium index that holds every block it is asked about, and counts the questions.


class IndexHoldingEverything(MediumIndex):
    """Every lookup is a full hit; ``lookups`` counts them, ``corrupt`` collects failed loads."""

    def __init__(self) -> None:
        self.lookups = 0
        self.corrupt: list[BlockHash] = []

    def count_held_prefix(self, group: int, block_hashes: Sequence[BlockHash]) -> int:
        self.lookups += 1
        return len(block_hashes)

    def complete_load(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        corrupt: Sequence[BlockHash],
        payload: TransferPayload | None = None,
    ) -> None:
        self.corrupt.extend(corrupt)


# CPU pool slots whose header names another block or layout: what a slot reused or mixed up
# looks like. The pool's payloads carry no checksum (only kvwire writes that memory), so these
# headers are what a load must refuse.

# Where the header's layout fingerprint and block hash lie (kvwire.blocks.format's header).
FINGERPRINT_AT = struct.calcsize("<4sHH")
BLOCK_HASH_AT = struct.calcsize("<4sHH16s")


def name_another_block(pool: PoolSlots, slot: int) -> None:
    """Make ``slot``'s header name another block hash; its payload is left as it is."""
    pool.entry(slot)[BLOCK_HASH_AT] ^= 0x01


def name_another_layout(pool: PoolSlots, slot: int) -> None:
    """Make ``slot``'s header name another layout fingerprint; its payload is left as it is."""
    pool.entry(slot)[FINGERPRINT_AT] ^= 0x01
