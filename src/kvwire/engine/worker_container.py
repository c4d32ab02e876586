"""The `WorkerContainer`: how one engine worker is assembled, in the engine's process or its own.

The engine's inline worker is this container composed into the
`EngineContainer`, sharing the engine's
connector source; a worker process (one rank of a parallel engine, or the
one worker of `worker_mode="process"`) builds one for itself, with its own
connectors.
"""

from __future__ import annotations

from dependency_injector import containers, providers, resources

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.container import KVConnectorContainer
from kvwire.engine.connector_source import ConnectorHook, ConnectorSource
from kvwire.engine.model import RankExchange, TinyTransformer
from kvwire.engine.paged_cache import PagedKVCache, allocate_paged_cache
from kvwire.engine.parallel import RankShare
from kvwire.engine.worker import Worker

__all__ = ["WorkerContainer"]


def _connector_config(config: EngineConfig, share: RankShare | None) -> EngineConfig:
    # A rank's connector sees its share: its model's heads and layers.
    return config if share is None else share.connector_config


def _model(
    config: EngineConfig,
    kv_cache: PagedKVCache,
    share: RankShare | None,
    exchange: RankExchange | None,
) -> TinyTransformer:
    return TinyTransformer(
        config.model_config,
        kv_cache.layer_names,
        config.scheduler_config.max_num_batched_tokens,
        kv_cache.layer_groups,
        kv_heads=None if share is None else share.kv_heads,
        layers=kv_cache.layers,
        exchange=exchange,
    )


class _WorkerConnectors(resources.Resource[ConnectorSource]):
    """The worker's connector source; shutting the resource down shuts its connector down."""

    def init(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        hook: ConnectorHook | None,
        connectors: KVConnectorContainer,
    ) -> ConnectorSource:
        return ConnectorSource(config, kv_cache_config, hook, connectors)

    def shutdown(self, source: ConnectorSource | None) -> None:
        if source is not None:
            source.shutdown()


class WorkerContainer(containers.DeclarativeContainer):
    """Assembles one engine worker: its paged KV cache, its model, its connector, the `Worker`.

    Inputs: `config` (the engine's `EngineConfig`), `kv_cache_config`
    (this worker's: a rank's share of the engine's), `share` and
    `exchange` (a rank's share and its process group; None for an unsplit
    worker), `torch_threads` and `connector_hook`. Parts: `connectors`
    (a `kvwire.KVConnectorContainer` of the
    worker's connector config), `connector_source`, `kv_cache` (a
    `PagedKVCache`), `model` and `worker`.
    """

    config = providers.Dependency(instance_of=EngineConfig)
    kv_cache_config = providers.Dependency(instance_of=KVCacheConfig)
    share: providers.Provider[RankShare | None] = providers.Object(None)
    exchange: providers.Provider[RankExchange | None] = providers.Object(None)
    torch_threads: providers.Provider[int | None] = providers.Object(1)
    connector_hook: providers.Provider[ConnectorHook | None] = providers.Object(None)

    connector_config = providers.Callable(_connector_config, config, share)
    # The rank is injected as any application injects a worker's rank: the
    # connector's heads and layers follow it.
    connectors = providers.Container(
        KVConnectorContainer,
        engine_config=connector_config,
        parallel_config=connector_config.provided.parallel_config,
    )
    connector_source = providers.Resource(
        _WorkerConnectors, connector_config, kv_cache_config, connector_hook, connectors
    )
    kv_cache = providers.Singleton(allocate_paged_cache, config, kv_cache_config, share)
    model = providers.Singleton(_model, config, kv_cache, share, exchange)
    worker = providers.Singleton(
        Worker, config, kv_cache, model, connector_source, torch_threads=torch_threads
    )
