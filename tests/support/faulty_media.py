"""Media whose chosen loads fail, and engines over them, for the engine's recovery tests.

Each medium is a :class:`~kvwire.testing.faulty_medium.FaultInjectingMedium` over the
directory medium, configured by class attributes, so a profile can name it
(``kv_connector_extra_config.medium: tests.support.faulty_media:Class``) for
a worker process. In process, :func:`over_medium` overrides the registry's
``directory`` medium the way a container user overrides a connector.
"""

from __future__ import annotations

import pathlib
from typing import Any

import attrs
from dependency_injector import providers

from kvwire.config import EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy
from kvwire.container import KVConnectorContainer, container_for_profile
from kvwire.media.base import Medium
from kvwire.media.store.directory import DirectoryMedium
from kvwire.registry import default_registry
from kvwire.testing.faulty_medium import FaultInjectingMedium


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
