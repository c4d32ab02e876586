"""MultiConnector answers every call of the base class as vLLM's does: for its children.

As vLLM's own MultiConnector test requires, every method and property the
base class defines is either overridden (reaching the children) or listed
here as safe to inherit, with the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch

from kvwire.config import EngineConfig
from kvwire.connectors.multi import MultiConnector
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.testing import IdleConnector
from tests.support.pairs import build_multi, engine_config

# Inherited on purpose: what the base does with them is right for the composite itself.
SAFE_TO_INHERIT = {
    "_cache_hit_source": "used only when no child serves the request's load",
    "role": "the composite's own role, which it builds its children in",
    "engine_config": "the composite's own config; each child holds its own copy",
    "kv_transfer_config": "the composite's own; each child's names the child",
    "kv_cache_config": "one KV cache, the same object every child was given",
    "_get_connector_metadata": "the composite's own bound metadata; bind/clear reach children",
    "has_connector_metadata": "the composite's own bound metadata; bind/clear reach children",
}


def test_every_base_class_call_is_delegated_or_declared_safe() -> None:
    defined = {name for name in vars(KVConnectorBase) if not name.startswith("__")}
    missing = sorted(
        name for name in defined - set(SAFE_TO_INHERIT) if name not in vars(MultiConnector)
    )
    assert missing == [], f"MultiConnector inherits, and so never asks its children: {missing}"
    # The list stays true: each entry is the base's and is not overridden after all.
    assert set(SAFE_TO_INHERIT) <= defined
    assert not set(SAFE_TO_INHERIT) & set(vars(MultiConnector))


class CrossLayerConnector(IdleConnector):
    """Prefers one KV tensor of all layers, and records the one it is given."""

    prefers: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cross_layers: list[tuple[torch.Tensor, Any]] = []

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return self.prefers

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        self.cross_layers.append((kv_cache, attn_backend))


class PerLayerConnector(CrossLayerConnector):
    prefers = False


def multi_of(role: KVConnectorRole, *names: str) -> MultiConnector:
    children = [{"kv_connector": name, "kv_connector_module_path": __name__} for name in names]
    return build_multi(role, {"connectors": children})


@pytest.mark.parametrize(
    ("children", "prefers"),
    [
        (("CrossLayerConnector",), True),
        (("CrossLayerConnector", "CrossLayerConnector"), True),
        (("CrossLayerConnector", "PerLayerConnector"), False),
        (("PerLayerConnector", "CrossLayerConnector"), False),
        (("IdleConnector", "CrossLayerConnector"), False),
    ],
)
def test_cross_layer_blocks_are_preferred_exactly_when_every_child_prefers_them(
    children: tuple[str, ...], prefers: bool
) -> None:
    # IdleConnector, the base's default, prefers per-layer tensors.
    assert multi_of(KVConnectorRole.WORKER, *children).prefer_cross_layer_blocks is prefers


def test_the_cross_layer_cache_reaches_every_child() -> None:
    multi = multi_of(KVConnectorRole.WORKER, "CrossLayerConnector", "CrossLayerConnector")
    kv_cache, backend = torch.zeros(4), object()

    multi.register_cross_layers_kv_cache(kv_cache, backend)

    for child in multi.children:
        assert isinstance(child, CrossLayerConnector)
        assert child.cross_layers == [(kv_cache, backend)]


@attrs.define
class RecordingMetrics:
    """The Prometheus metrics of one connector class: what it was built from and observed."""

    vllm_config: EngineConfig
    observed: list[tuple[Any, int]] = attrs.field(factory=list)

    def observe(self, transfer_stats_data: Any, engine_idx: int = 0) -> None:
        self.observed.append((transfer_stats_data, engine_idx))


class MetricsConnector(IdleConnector):
    """A child with Prometheus metrics of its own; counts how often its class built them."""

    builds: ClassVar[int] = 0

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: EngineConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> RecordingMetrics:
        cls.builds += 1
        return RecordingMetrics(vllm_config)


def test_each_child_class_builds_its_metrics_once_and_observes_its_own_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(MetricsConnector, "builds", 0)
    children = [
        {"kv_connector": "MetricsConnector", "kv_connector_module_path": __name__},
        {"kv_connector": "CPUOffloadConnector", "kv_connector_extra_config": {}},
        {"kv_connector": "MetricsConnector", "kv_connector_module_path": __name__},
    ]
    config = engine_config("MultiConnector", {"connectors": children})

    metrics = MultiConnector.build_prom_metrics(config, {}, ["engine"], {0: ["0"]})

    assert MetricsConnector.builds == 1
    # The CPU offload connector has no metrics: it is left out, as vLLM leaves it.
    assert set(metrics.by_child) == {"MetricsConnector", "MetricsConnector#2"}
    child_metrics = metrics.by_child["MetricsConnector"]
    assert child_metrics.vllm_config.kv_transfer_config.kv_connector == "MetricsConnector"
    metrics.observe(
        {"MetricsConnector": {"saved": 1}, "CPUOffloadConnector": {"saved": 2}}, engine_idx=0
    )
    assert child_metrics.observed == [({"saved": 1}, 0)]
