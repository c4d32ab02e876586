"""Engine configs for connector tests: name a connector by name, class or profile."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from kvwire.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoadFailurePolicy,
    ModelConfig,
)

ConnectorSpec = str | type | os.PathLike[str]


def conformance_engine_config(
    connector: ConnectorSpec,
    *,
    extra_config: Mapping[str, Any] | None = None,
    kv_role: str = "kv_both",
    block_size: int = 4,
    num_gpu_blocks: int = 128,
) -> EngineConfig:
    """A small engine config naming `connector`.

    `connector` is a registered name (`"CPUOffloadConnector"`), a
    connector class (found by its module path), or a path to a profile (YAML,
    whose model and cache shapes are kept as they are).
    """
    if isinstance(connector, os.PathLike) or (
        isinstance(connector, str) and connector.endswith((".yaml", ".yml"))
    ):
        from kvwire.config.profile import load_profile

        return load_profile(os.fspath(connector))
    if isinstance(connector, type):
        name, module_path = connector.__name__, connector.__module__
    else:
        name, module_path = connector, None
    transfer = KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module_path,
        kv_role=kv_role,  # type: ignore[arg-type]
        kv_connector_extra_config=dict(extra_config or {}),
    )
    return EngineConfig(
        model_config=ModelConfig(num_layers=2, vocab_size=300, max_model_len=512),
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks),
        kv_transfer_config=transfer,
    )


def with_load_failure_policy(config: EngineConfig, policy: LoadFailurePolicy) -> EngineConfig:
    """`config` whose connector answers load failures by `policy` ("recompute" or "fail")."""
    assert config.kv_transfer_config is not None
    transfer = attrs.evolve(config.kv_transfer_config, kv_load_failure_policy=policy)
    return attrs.evolve(config, kv_transfer_config=transfer)


HYBRID_LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
"""The kit's hybrid model: sliding-window and full-attention layers alternating, as in Gemma."""


def hybrid_engine_config(config: EngineConfig) -> EngineConfig:
    """`config` with a tiny hybrid model, and the HMA gate left to decide.

    Four layers, sliding-window and full attention alternating; the window is
    two blocks, shorter than the kit's prompts, so a sliding-window group's
    first blocks leave it. `disable_hybrid_kv_cache_manager` is unset, as a
    user leaves it: HMA stays on exactly when the connector serves it.
    """
    model = attrs.evolve(
        config.model_config,
        num_layers=len(HYBRID_LAYER_TYPES),
        layer_types=HYBRID_LAYER_TYPES,
        sliding_window=2 * config.cache_config.block_size,
    )
    scheduler = attrs.evolve(config.scheduler_config, disable_hybrid_kv_cache_manager=None)
    return attrs.evolve(config, model_config=model, scheduler_config=scheduler)


def with_hma_disabled(config: EngineConfig) -> EngineConfig:
    """`config` with `disable_hybrid_kv_cache_manager: true`: one group of every layer."""
    scheduler = attrs.evolve(config.scheduler_config, disable_hybrid_kv_cache_manager=True)
    return attrs.evolve(config, scheduler_config=scheduler)
