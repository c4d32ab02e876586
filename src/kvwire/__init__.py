"""kvwire: KV-cache connectors for LLM inference engines, built through dependency injection.

This package only re-exports the public names; importing it imports neither
torch nor any connector module. The other import points are
:mod:`kvwire.media` (writing a medium), :mod:`kvwire.testing` (the
conformance kit), :mod:`kvwire.vllm` (the vLLM adapter) and
:mod:`kvwire.exceptions` (every error kvwire raises).
"""

from importlib.metadata import PackageNotFoundError, version

from kvwire._moved import install_moved_module_finder
from kvwire.config import EngineConfig, KVTransferConfig, SchedulerConfig
from kvwire.config.kv_cache import KVCacheConfig, build_full_attention_kv_cache_config
from kvwire.config.profile import load_profile
from kvwire.container import KVConnectorContainer, container_for_profile, declare_role
from kvwire.exceptions import KVWireError
from kvwire.factory import KVConnectorFactory
from kvwire.hma import HMADecision
from kvwire.interface.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from kvwire.interface.types import (
    ForwardContext,
    KVCacheBlocks,
    Request,
    ScheduledRequest,
    SchedulerOutput,
)
from kvwire.registry import ConnectorRegistry, default_registry

try:
    # The one place the version is written is pyproject.toml; installed, it is the metadata's.
    __version__ = version("kvwire")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ConnectorRegistry",
    "EngineConfig",
    "ForwardContext",
    "HMADecision",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVConnectorBase",
    "KVConnectorContainer",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVTransferConfig",
    "KVWireError",
    "Request",
    "ScheduledRequest",
    "SchedulerConfig",
    "SchedulerOutput",
    "SupportsHMA",
    "build_full_attention_kv_cache_config",
    "container_for_profile",
    "declare_role",
    "default_registry",
    "load_profile",
    "supports_hma",
]

# Old module names keep importing, with a DeprecationWarning, for one release.
install_moved_module_finder()
