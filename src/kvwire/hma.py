"""The HMA gate: whether the hybrid KV cache manager runs with the configured connector.

``SchedulerConfig.disable_hybrid_kv_cache_manager`` is read as the reference
reads it: ``True`` turns HMA off without asking the connector; ``False``
demands HMA, so a connector that cannot serve several KV cache groups is an
error; ``None`` ("auto") keeps HMA on exactly when the connector supports it,
and says so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from kvwire.config import EngineConfig, SchedulerConfig

logger = logging.getLogger(__name__)


@attrs.frozen
class HMADecision:
    """Whether HMA is enabled, and the reason, in words (read-only)."""

    enabled: bool
    reason: str


def decide_hma(
    scheduler_config: SchedulerConfig, connector_name: str, is_supported: Callable[[], bool]
) -> HMADecision:
    """Apply the gate. ``is_supported`` is asked only when the answer matters."""
    disable = scheduler_config.disable_hybrid_kv_cache_manager
    if disable is True:
        return HMADecision(
            enabled=False, reason="disable_hybrid_kv_cache_manager is true: HMA is off"
        )
    supported = is_supported()
    if disable is False:
        if not supported:
            raise ValueError(
                f"Connector {connector_name} does not support HMA but "
                f"HMA is enabled. Please set `--disable-hybrid-kv-cache-manager`."
            )
        return HMADecision(
            enabled=True,
            reason=f"disable_hybrid_kv_cache_manager is false and {connector_name} supports HMA",
        )
    if supported:
        reason = (
            f"disable_hybrid_kv_cache_manager is unset and {connector_name} supports HMA: "
            "HMA stays on"
        )
    else:
        reason = (
            f"disable_hybrid_kv_cache_manager is unset and {connector_name} does not support "
            "HMA: HMA is turned off"
        )
    logger.info("HMA gate: %s", reason)
    return HMADecision(enabled=supported, reason=reason)


def with_hma_decision(engine_config: EngineConfig, decision: HMADecision) -> EngineConfig:
    """``engine_config`` with an "auto" HMA setting replaced by the gate's decision.

    Connectors then see a definite ``disable_hybrid_kv_cache_manager``, as
    they do in the reference once the engine has decided.
    """
    scheduler_config = engine_config.scheduler_config
    if scheduler_config.disable_hybrid_kv_cache_manager is not None:
        return engine_config
    decided = attrs.evolve(scheduler_config, disable_hybrid_kv_cache_manager=not decision.enabled)
    return attrs.evolve(engine_config, scheduler_config=decided)
