"""Plug-in registries: connector, medium and eviction policy names, each a lazy provider.

`connectors` resolves a `KVTransferConfig` to a
connector class as vLLM's factory does; `media` names
the media an offload connector keeps blocks in; `eviction` the policies a CPU
pool evicts by. All serve names from the same three places (kvwire's own,
installed entry points, registered at run time).
"""

from kvwire.registry.connectors import (
    BUILT_IN_CONNECTORS,
    ENTRY_POINT_GROUP,
    MAX_COMPOSITE_DEPTH,
    ConnectorRegistry,
    ModulePathError,
    accepts_connector_builder,
    accepts_keyword_only,
    accepts_medium,
    check_connector_class,
    default_registry,
)
from kvwire.registry.eviction import (
    BUILT_IN_EVICTION_POLICIES,
    EVICTION_POLICIES_ENTRY_POINT_GROUP,
    EvictionPolicyRegistry,
    UnknownEvictionPolicyError,
)
from kvwire.registry.media import (
    BUILT_IN_MEDIA,
    MEDIA_ENTRY_POINT_GROUP,
    MediumRegistry,
    UnknownMediumError,
)
from kvwire.registry.names import PluginSource, RegisteredPlugin

__all__ = [
    "BUILT_IN_CONNECTORS",
    "BUILT_IN_EVICTION_POLICIES",
    "BUILT_IN_MEDIA",
    "ENTRY_POINT_GROUP",
    "EVICTION_POLICIES_ENTRY_POINT_GROUP",
    "MAX_COMPOSITE_DEPTH",
    "MEDIA_ENTRY_POINT_GROUP",
    "ConnectorRegistry",
    "EvictionPolicyRegistry",
    "MediumRegistry",
    "ModulePathError",
    "PluginSource",
    "RegisteredPlugin",
    "UnknownEvictionPolicyError",
    "UnknownMediumError",
    "accepts_connector_builder",
    "accepts_keyword_only",
    "accepts_medium",
    "check_connector_class",
    "default_registry",
]
