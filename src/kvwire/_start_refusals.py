"""What `kvwire check` refuses because a connector's start would refuse it for the profile's model.

The extra config's own checks see the keys alone; the engine checks the
parallel layout against the model (a tensor-parallel size that does not
divide the KV heads), and a block connector's medium checks its options
against the model's cache layout when it is built (a CPU pool smaller than
one block). `kvwire check` runs those: the layout's checks, then each block
connector's medium, built from the KV cache the engine would give rank 0's
connector, neither half of it (no index, no pool, no connection).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.config.extra_config import ExtraConfigError
from kvwire.config.kv_cache import KVCacheConfig, build_kv_cache_config
from kvwire.hma import HMADecision, with_hma_decision
from kvwire.interface.base import KVConnectorBase

ConnectorResolver = Callable[[KVTransferConfig], type[KVConnectorBase]]
MediumResolver = Callable[[str], type]

_BLOCK_CONNECTOR_MODULE = "kvwire.connectors.offload.connector"


def refuse_at_start(
    engine_config: EngineConfig,
    decision: HMADecision,
    connector_cls: type[KVConnectorBase],
    resolve: ConnectorResolver,
    medium_resolver: MediumResolver,
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
    _refuse(decided, transfer, connector_cls, "", resolve, medium_resolver, kv_cache_config)


def _refuse(
    config: EngineConfig,
    transfer: KVTransferConfig,
    connector_cls: type[KVConnectorBase],
    where: str,
    resolve: ConnectorResolver,
    medium_resolver: MediumResolver,
    kv_cache_config: KVCacheConfig,
) -> None:
    block_connector = _block_connector_class()
    if block_connector is not None and issubclass(connector_cls, block_connector):
        # The class itself: a preset names its own default medium.
        build_medium: Any = getattr(connector_cls, "build_medium")  # noqa: B009
        try:
            build_medium(config, kv_cache_config, medium_resolver)
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
            resolve(child_transfer),
            child_where,
            resolve,
            medium_resolver,
            kv_cache_config,
        )


def _block_connector_class() -> Any:
    """kvwire's block connector class, if a connector resolved so far is one.

    Its module needs the torch extra's xxhash, so it is never imported here:
    a class deriving from it has imported it already.
    """
    module = sys.modules.get(_BLOCK_CONNECTOR_MODULE)
    return None if module is None else module.OffloadConnector
