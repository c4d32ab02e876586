"""`KVConnectorFactory`: vLLM's factory's API, served by kvwire's registry.

Code written against vLLM moves over by changing its import. Every
call goes to the process-wide `kvwire.default_registry` (the
one new containers use too), and `create_connector` builds through a
`kvwire.KVConnectorContainer`, so there is one registry and
one way of building, whichever API is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dependency_injector import providers

from kvwire.container import KVConnectorContainer, role_connector_provider
from kvwire.registry import default_registry

if TYPE_CHECKING:
    from kvwire.config import EngineConfig, KVTransferConfig
    from kvwire.config.kv_cache import KVCacheConfig
    from kvwire.interface.base import KVConnectorBase, KVConnectorRole


class KVConnectorFactory:
    """vLLM's class-level connector factory, with its behaviour and messages."""

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register a connector with a lazy-loading module and class name."""
        default_registry().register_connector(name, module_path, class_name)

    @classmethod
    def get_connector_class_by_name(cls, connector_name: str) -> type[KVConnectorBase]:
        """The class registered as `connector_name` (or found by module path earlier).

        An unknown name raises `Connector '<name>' is not registered.`.
        """
        return default_registry().get_class(connector_name)

    @classmethod
    def get_connector_class(cls, kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase]:
        """The class `kv_transfer_config` names (module path first, then the registry)."""
        return default_registry().resolve(kv_transfer_config)

    @classmethod
    def create_connector(
        cls, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> KVConnectorBase:
        """Build the connector for `role`; the caller owns it and calls its `shutdown()`."""
        container = KVConnectorContainer()
        container.engine_config.override(providers.Object(config))
        container.kv_cache_config.override(providers.Object(kv_cache_config))
        connector: KVConnectorBase = role_connector_provider(container, role)()
        return connector

    @classmethod
    def supports_hma_config(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Whether the configured connector supports HMA (a composite: every child does)."""
        return default_registry().supports_hma_config(kv_transfer_config)
