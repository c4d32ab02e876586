"""Plug-in registries: connector names and medium names, each a lazy provider.

`connectors` resolves a `KVTransferConfig` to a
connector class as vLLM's factory does; `media` names
the media a block connector keeps blocks in. Both serve names from the same
three places (kvwire's own, installed entry points, registered at run time).
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
from kvwire.registry.media import (
    BUILT_IN_MEDIA,
    MEDIA_ENTRY_POINT_GROUP,
    MediumRegistry,
    UnknownMediumError,
)
from kvwire.registry.names import PluginSource, RegisteredPlugin

__all__ = [
    "BUILT_IN_CONNECTORS",
    "BUILT_IN_MEDIA",
    "ENTRY_POINT_GROUP",
    "MAX_COMPOSITE_DEPTH",
    "MEDIA_ENTRY_POINT_GROUP",
    "ConnectorRegistry",
    "MediumRegistry",
    "ModulePathError",
    "PluginSource",
    "RegisteredPlugin",
    "UnknownMediumError",
    "accepts_connector_builder",
    "accepts_keyword_only",
    "accepts_medium",
    "check_connector_class",
    "default_registry",
]
