"""The HMA gate: whether the hybrid KV cache manager runs with the configured connector.

`SchedulerConfig.disable_hybrid_kv_cache_manager` is read as vLLM
reads it: `True` turns HMA off without asking the connector; `False`
demands HMA, so a connector that cannot serve several KV cache groups is an
error; `None` ("auto") keeps HMA on exactly when the connector supports it,
and says so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from kvwire.config import EngineConfig, SchedulerConfig

if TYPE_CHECKING:
    from kvwire.interface.base import KVConnectorBase

logger = logging.getLogger(__name__)


@attrs.frozen
class HMADecision:
    """Whether HMA is enabled, and the reason, in words (read-only)."""

    enabled: bool
    reason: str


def decide_hma(
    scheduler_config: SchedulerConfig, connector_name: str, is_supported: Callable[[], bool]
) -> HMADecision:
    """Apply the gate. `is_supported` is asked only when the answer matters."""
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
    """`engine_config` with an "auto" HMA setting replaced by the gate's decision.

    Connectors then see a definite `disable_hybrid_kv_cache_manager`, as
    they do in vLLM once the engine has decided.
    """
    scheduler_config = engine_config.scheduler_config
    if scheduler_config.disable_hybrid_kv_cache_manager is not None:
        return engine_config
    decided = attrs.evolve(scheduler_config, disable_hybrid_kv_cache_manager=not decision.enabled)
    return attrs.evolve(engine_config, scheduler_config=decided)


def describe_class_support(connector_cls: type[KVConnectorBase]) -> str:
    """Whether a connector class serves HMA, and why, for `kvwire connectors --resolve`.

    A class with its own `supports_hma_for_config` (a composite) decides
    per configuration: the first line of that hook's docstring says how.
    """
    from kvwire.interface.base import KVConnectorBase, supports_hma

    hook = connector_cls.supports_hma_for_config
    if getattr(hook, "__func__", hook) is not getattr(
        KVConnectorBase.supports_hma_for_config, "__func__", None
    ):
        rule = (hook.__doc__ or "").strip().splitlines()
        how = f"{connector_cls.__name__}.supports_hma_for_config decides"
        if rule:
            how = rule[0].rstrip(".")
        return f"depends on its configuration: {how}"
    if supports_hma(connector_cls):
        return "yes (subclasses SupportsHMA: the gate keeps HMA on)"
    return (
        "no (does not subclass SupportsHMA: the gate turns HMA off, and "
        "disable_hybrid_kv_cache_manager: false is an error)"
    )


def describe_kv_cache_groups(engine_config: EngineConfig, decision: HMADecision) -> str:
    """What the gate's decision means for the model's KV cache, for `kvwire check`."""
    from kvwire.config.kv_cache import build_kv_cache_config, sliding_window_of

    if not engine_config.model_config.is_hybrid:
        return "KV cache groups: 1 (every layer full attention: HMA changes nothing for this model)"
    groups = build_kv_cache_config(engine_config, decision.enabled).kv_cache_groups
    windows = [sliding_window_of(group.kv_cache_spec) for group in groups]
    # Told by the specs, not the group count: a model whose every layer is
    # sliding-window has one group with HMA on too, a sliding-window one.
    if all(window is None for window in windows):
        return (
            "KV cache groups: 1 with HMA off (the sliding-window layers share one "
            "full-attention group: every block of every layer is kept and moved)"
        )
    described = []
    for index, (group, window) in enumerate(zip(groups, windows, strict=True)):
        kind = "full attention" if window is None else f"sliding window {window}"
        described.append(f"group {index}: {kind}, {', '.join(group.layer_names)}")
    return (
        f"KV cache groups: {len(groups)} with HMA on ({'; '.join(described)}); a "
        "sliding-window group keeps and moves only the blocks inside its window"
    )
