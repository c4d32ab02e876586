"""Where the engine gets its connectors: the one place that knows how they are built.

The engine asks for one connector per role. They come from the
:class:`kvwire.container.KVConnectorContainer`'s role-scoped providers, so a
profile, provider overrides, module paths and entry points all apply exactly
as they do for any application wired to the container.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvwire.config import EngineConfig
from kvwire.connector.base import KVConnectorBase, KVConnectorRole
from kvwire.kv_cache_config import KVCacheConfig

ConnectorHook = Callable[[KVConnectorBase], None]
"""Called with every connector the source builds (e.g. the conformance kit's instruments)."""


class ConnectorSource:
    """Builds, hands out and shuts down the connectors of one engine process.

    ``connector(role)`` returns the same instance for a role every time, or
    None when the config names no connector. ``hook`` sees each connector
    once, right after it is built; it must be picklable when the worker runs
    in its own process.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        hook: ConnectorHook | None = None,
    ) -> None:
        self._config = config
        self._kv_cache_config = kv_cache_config
        self._hook = hook
        self._container: Any = None
        self._built: dict[KVConnectorRole, KVConnectorBase] = {}

    def connector(self, role: KVConnectorRole) -> KVConnectorBase | None:
        if (
            self._config.kv_transfer_config is None
            or self._config.kv_transfer_config.kv_connector is None
        ):
            return None
        if role not in self._built:
            connector = self._build(role)
            if self._hook is not None:
                self._hook(connector)
            self._built[role] = connector
        return self._built[role]

    def shutdown(self) -> None:
        """Shut down every connector built here, once."""
        if self._container is not None:
            self._container.shutdown_resources()
            self._container = None
        else:
            for connector in self._built.values():
                connector.shutdown()
        self._built.clear()

    def _build(self, role: KVConnectorRole) -> KVConnectorBase:
        container = self._get_container()
        if container is None:
            return _build_directly(self._config, role, self._kv_cache_config)
        provider = (
            container.scheduler_connector
            if role is KVConnectorRole.SCHEDULER
            else container.worker_connector
        )
        connector: KVConnectorBase = provider()
        return connector

    def _get_container(self) -> Any:
        if self._container is None:
            try:
                container_module = importlib.import_module("kvwire.container")
            except ModuleNotFoundError as error:
                if error.name != "kvwire.container":
                    raise
                return None
            from dependency_injector import providers

            container = container_module.KVConnectorContainer()
            container.engine_config.override(providers.Object(self._config))
            container.kv_cache_config.override(providers.Object(self._kv_cache_config))
            self._container = container
        return self._container


# Until the core team's container exists: the contract's built-in names.
_BUILT_IN = {
    "CPUOffloadConnector": "kvwire.connectors.cpu_offload:CPUOffloadConnector",
    "SharedStorageConnector": "kvwire.connectors.shared_storage:SharedStorageConnector",
    "MultiConnector": "kvwire.connectors.multi:MultiConnector",
    "RedisConnector": "kvwire.connectors.redis:RedisConnector",
}


def _build_directly(
    config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
) -> KVConnectorBase:
    transfer = config.kv_transfer_config
    assert transfer is not None and transfer.kv_connector is not None
    if transfer.kv_connector_module_path:
        module_path, class_name = transfer.kv_connector_module_path, transfer.kv_connector
    elif transfer.kv_connector in _BUILT_IN:
        module_path, class_name = _BUILT_IN[transfer.kv_connector].split(":")
    else:
        raise ValueError(f"Unsupported connector type: {transfer.kv_connector}")
    connector_class = getattr(importlib.import_module(module_path), class_name)
    import inspect

    if "connector_builder" in inspect.signature(connector_class).parameters:
        built: KVConnectorBase = connector_class(
            config, role, kv_cache_config, connector_builder=_build_directly
        )
        return built
    built = connector_class(config, role, kv_cache_config)
    return built
