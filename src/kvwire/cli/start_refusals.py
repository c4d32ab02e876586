"""What `kvwire check` refuses because a connector's start would refuse it for the profile's model.

The extra config's own checks see the keys alone; the engine checks the
parallel layout against the model (a tensor-parallel size that does not
divide the KV heads), and an offload connector's medium checks its options
against the model's cache layout when it is built (a CPU pool smaller than
one block). `kvwire check` runs those: the layout's checks, then each block
connector's medium, built by a container's `medium` provider from the KV
cache the engine would give rank 0's connector, neither half of it (no
index, no pool, no connection).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from dependency_injector import providers

from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.config.kv_cache import KVCacheConfig, build_kv_cache_config
from kvwire.container import KVConnectorContainer
from kvwire.hma import HMADecision, with_hma_decision
from kvwire.interface.base import KVConnectorBase
from kvwire.registry import ConnectorRegistry, accepts_medium


def refuse_at_start(
    engine_config: EngineConfig,
    decision: HMADecision,
    connector_cls: type[KVConnectorBase],
    registry: ConnectorRegistry,
) -> None:
    """Raise what building `connector_cls` (and each child a composite lists) would raise first.

    The error names the field (`kv_connector_extra_config.cpu_pool_bytes`,
    prefixed by the child's path for a composite's child) and the smallest
    value accepted, as the engine's own refusal does.
    """
    decided = with_hma_decision(engine_config, decision)
    kv_cache_config = build_kv_cache_config(decided, decision.enabled)
    parallel = decided.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        # A split engine refuses a layout it cannot run (heads the ranks cannot share
        # evenly), by field; each rank's connector is built for its own share.
        # Imported here: `kvwire connectors` imports no engine module.
        from kvwire.engine.parallel import rank_share

        share = rank_share(decided, kv_cache_config, 0)
        decided, kv_cache_config = share.connector_config, share.kv_cache_config
    transfer = decided.kv_transfer_config
    if transfer is None:
        return
    _refuse(decided, transfer, connector_cls, "", registry, kv_cache_config)


def _refuse(
    config: EngineConfig,
    transfer: KVTransferConfig,
    connector_cls: type[KVConnectorBase],
    where: str,
    registry: ConnectorRegistry,
    kv_cache_config: KVCacheConfig,
) -> None:
    if accepts_medium(connector_cls):
        try:
            _build_medium_alone(config, connector_cls, registry, kv_cache_config)
        except ValueError as error:
            if not where:
                raise
            raise ExtraConfigError(f"{where}{error}") from None
        return
    # A composite's children, listed vLLM's way; each was resolved by check already.
    children = transfer.kv_connector_extra_config.get("connectors")
    if not isinstance(children, list):
        return
    inherited = {"engine_id": transfer.engine_id, "kv_role": transfer.kv_role}
    for index, child in enumerate(children):
        if not isinstance(child, Mapping):
            continue
        child_transfer = KVTransferConfig(**{**inherited, **child})
        child_config = attrs.evolve(config, kv_transfer_config=child_transfer)
        child_where = f"{where}kv_transfer_config.kv_connector_extra_config.connectors[{index}]: "
        _refuse(
            child_config,
            child_transfer,
            registry.resolve(child_transfer),
            child_where,
            registry,
            kv_cache_config,
        )


def _build_medium_alone(
    config: EngineConfig,
    connector_cls: type[KVConnectorBase],
    registry: ConnectorRegistry,
    kv_cache_config: KVCacheConfig,
) -> None:
    """What the `medium` provider of a container building `connector_cls` for `config` raises.

    The medium is built alone, neither half of the connector: it reads its
    options and the layout; its index and its handler, which connect and
    allocate, are the halves' to build.
    """
    container = KVConnectorContainer()
    container.registry.override(providers.Object(registry))
    container.engine_config.override(providers.Object(config))
    container.connector_class.override(providers.Object(connector_cls))
    # The HMA gate and the rank's share are decided already, for the whole engine.
    container.connector_engine_config.override(providers.Object(config))
    container.kv_cache_config.override(providers.Object(kv_cache_config))
    container.medium()
