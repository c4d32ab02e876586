"""Where the engine gets its connectors: the container's role-scoped providers.

The engine asks for one connector per role. They come from a
`kvwire.KVConnectorContainer` set up with the engine's
config and sized `kv_cache_config`, so the registry, module paths, entry
points, provider overrides and the HMA gate all apply exactly as they do for
any application wired to the container.
"""

from __future__ import annotations

from collections.abc import Callable

from dependency_injector import providers

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.container import KVConnectorContainer, role_connector_provider
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.interface.types import KVConnectorStats

ConnectorHook = Callable[[KVConnectorBase], None]
"""Called with every connector the source builds (e.g. the conformance kit's instruments)."""

ContainerHook = Callable[[KVConnectorContainer], None]
"""Called with a worker process's container before its connector is built, to override providers."""


class ConnectorSource:
    """The connectors of one engine process, from one container.

    `connector(role)` returns the same instance for a role every time, or
    None when the config names no connector. `hook` sees each connector
    once, right after it is built; it must be picklable when the worker runs
    in its own process. `container` is set up with `config` already (the
    engine's containers compose it) and gets `kv_cache_config` here.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        hook: ConnectorHook | None,
        container: KVConnectorContainer,
    ) -> None:
        self._enabled = (
            config.kv_transfer_config is not None
            and config.kv_transfer_config.kv_connector is not None
        )
        self._hook = hook
        self._built: dict[KVConnectorRole, KVConnectorBase] = {}
        container.kv_cache_config.override(providers.Object(kv_cache_config))
        self.container = container

    def connector(self, role: KVConnectorRole) -> KVConnectorBase | None:
        if not self._enabled:
            return None
        if role not in self._built:
            connector: KVConnectorBase = role_connector_provider(self.container, role)()
            if self._hook is not None:
                self._hook(connector)
            self._built[role] = connector
        return self._built[role]

    def shutdown(self) -> KVConnectorStats | None:
        """Shut down every connector built here (the container's resources), once.

        Returns the worker connector's last stats, taken after its shutdown:
        the transfers its shutdown waited for end after the last step's
        report, and are counted only there.
        """
        if not self._built:
            return None
        worker_connector = self._built.get(KVConnectorRole.WORKER)
        self._built.clear()
        self.container.shutdown_resources()
        return None if worker_connector is None else worker_connector.get_kv_connector_stats()
