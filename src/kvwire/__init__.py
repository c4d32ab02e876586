"""kvwire: KV-cache connectors for LLM inference engines, built through dependency injection.

This package only re-exports the public names, each imported on first use:
importing it imports nothing else of kvwire, and never torch or a connector.
The other import points are `kvwire.media` (writing a medium),
`kvwire.testing` (the conformance kit), `kvwire.vllm` (the vLLM
adapter) and `kvwire.exceptions` (every error kvwire raises).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvwire.common.lazy_exports import lazy_exports

# Each public name and the module that defines it, imported on first use: a
# project that has kvwire installed pays nothing for it (pytest loads
# kvwire's plugin in every such project) until it uses a name.
_EXPORTS = {
    "AttentionSpec": "kvwire.config.kv_cache",
    "BlockHash": "kvwire.interface.types",
    "BlockRemoved": "kvwire.interface.types",
    "BlockStored": "kvwire.interface.types",
    "CacheConfig": "kvwire.config",
    "CacheHitSource": "kvwire.interface.types",
    "ConnectorLookup": "kvwire.interface.base",
    "ConnectorRegistry": "kvwire.registry",
    "Counters": "kvwire.interface.counters",
    "EngineConfig": "kvwire.config",
    "ForwardContext": "kvwire.interface.types",
    "ForwardingConnector": "kvwire.interface.forwarding",
    "FullAttentionSpec": "kvwire.config.kv_cache",
    "HMADecision": "kvwire.hma",
    "KVCacheBlocks": "kvwire.interface.types",
    "KVCacheConfig": "kvwire.config.kv_cache",
    "KVCacheEvent": "kvwire.interface.types",
    "KVCacheGroupSpec": "kvwire.config.kv_cache",
    "KVCacheTensor": "kvwire.config.kv_cache",
    "KVConnectorBase": "kvwire.interface.base",
    "KVConnectorContainer": "kvwire.container",
    "KVConnectorFactory": "kvwire.factory",
    "KVConnectorHandshakeMetadata": "kvwire.interface.base",
    "KVConnectorMetadata": "kvwire.interface.base",
    "KVConnectorOutput": "kvwire.interface.types",
    "KVConnectorRole": "kvwire.interface.base",
    "KVConnectorStats": "kvwire.interface.types",
    "KVConnectorTransferResults": "kvwire.interface.types",
    "KVConnectorWorkerMetadata": "kvwire.interface.base",
    "KVTransferConfig": "kvwire.config",
    "KVWireError": "kvwire.exceptions",
    "MediumLookup": "kvwire.interface.base",
    "ModelConfig": "kvwire.config",
    "ParallelConfig": "kvwire.config",
    "PluginSource": "kvwire.registry",
    "RegisteredPlugin": "kvwire.registry",
    "Request": "kvwire.interface.types",
    "RequestStatus": "kvwire.interface.types",
    "RoleSplitConnector": "kvwire.interface.roles",
    "ScheduledRequest": "kvwire.interface.types",
    "SchedulerConfig": "kvwire.config",
    "SchedulerOutput": "kvwire.interface.types",
    "SlidingWindowSpec": "kvwire.config.kv_cache",
    "SupportsHMA": "kvwire.interface.base",
    "build_full_attention_kv_cache_config": "kvwire.config.kv_cache",
    "container_for_profile": "kvwire.container",
    "declare_role": "kvwire.container",
    "default_registry": "kvwire.registry",
    "load_profile": "kvwire.config.profile",
    "supports_hma": "kvwire.interface.base",
}

if TYPE_CHECKING:
    from kvwire.config import (
        CacheConfig,
        EngineConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from kvwire.config.kv_cache import (
        AttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
        build_full_attention_kv_cache_config,
    )
    from kvwire.config.profile import load_profile
    from kvwire.container import KVConnectorContainer, container_for_profile, declare_role
    from kvwire.exceptions import KVWireError
    from kvwire.factory import KVConnectorFactory
    from kvwire.hma import HMADecision
    from kvwire.interface.base import (
        ConnectorLookup,
        KVConnectorBase,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
        MediumLookup,
        SupportsHMA,
        supports_hma,
    )
    from kvwire.interface.counters import Counters
    from kvwire.interface.forwarding import ForwardingConnector
    from kvwire.interface.roles import RoleSplitConnector
    from kvwire.interface.types import (
        BlockHash,
        BlockRemoved,
        BlockStored,
        CacheHitSource,
        ForwardContext,
        KVCacheBlocks,
        KVCacheEvent,
        KVConnectorOutput,
        KVConnectorStats,
        KVConnectorTransferResults,
        Request,
        RequestStatus,
        ScheduledRequest,
        SchedulerOutput,
    )
    from kvwire.registry import (
        ConnectorRegistry,
        PluginSource,
        RegisteredPlugin,
        default_registry,
    )

    __version__: str


_exported, __dir__ = lazy_exports(globals(), _EXPORTS)


def __getattr__(name: str) -> object:
    if name == "__version__":
        return _installed_version()
    return _exported(name)


def _installed_version() -> str:
    # The one place the version is written is pyproject.toml; installed, it is the metadata's.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvwire")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


__all__ = [
    "AttentionSpec",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheHitSource",
    "ConnectorLookup",
    "ConnectorRegistry",
    "Counters",
    "EngineConfig",
    "ForwardContext",
    "ForwardingConnector",
    "FullAttentionSpec",
    "HMADecision",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheTensor",
    "KVConnectorBase",
    "KVConnectorContainer",
    "KVConnectorFactory",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "KVTransferConfig",
    "KVWireError",
    "MediumLookup",
    "ModelConfig",
    "ParallelConfig",
    "PluginSource",
    "RegisteredPlugin",
    "Request",
    "RequestStatus",
    "RoleSplitConnector",
    "ScheduledRequest",
    "SchedulerConfig",
    "SchedulerOutput",
    "SlidingWindowSpec",
    "SupportsHMA",
    "build_full_attention_kv_cache_config",
    "container_for_profile",
    "declare_role",
    "default_registry",
    "load_profile",
    "supports_hma",
]
