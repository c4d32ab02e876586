"""Fixtures of the core tests: a private registry, a sized KV cache, engine configs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dependency_injector import providers

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig, build_full_attention_kv_cache_config
from kvwire.config.profile import load_profile
from kvwire.container import KVConnectorContainer
from kvwire.registry import ConnectorRegistry

SAMPLES = "tests.support.sample_connectors"


@pytest.fixture
def registry() -> ConnectorRegistry:
    """A registry that knows the sample connectors and nothing installed."""
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    for name in (
        "RecordingConnector",
        "HMAConnector",
        "CompositeConnector",
        "CompositeSubclass",
        "VarKeywordConnector",
        "TwoArgumentConnector",
    ):
        registry.register_connector(name, SAMPLES, name)
    return registry


@pytest.fixture
def kv_cache_config() -> KVCacheConfig:
    return build_full_attention_kv_cache_config(
        num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_size=8, dtype="float32"
    )


EngineConfigMaker = Callable[..., EngineConfig]


@pytest.fixture
def make_engine_config() -> EngineConfigMaker:
    """``make_engine_config("Name", disable_hma=None, **transfer_fields)``."""

    def make(connector: str, *, disable_hma: bool | None = None, **transfer: Any) -> EngineConfig:
        return load_profile(
            {
                "scheduler_config": {"disable_hybrid_kv_cache_manager": disable_hma},
                "kv_transfer_config": {"kv_connector": connector, "kv_role": "kv_both", **transfer},
            }
        )

    return make


@pytest.fixture
def make_container(
    registry: ConnectorRegistry, kv_cache_config: KVCacheConfig
) -> Callable[[EngineConfig], Any]:
    """A container on the private registry, with the sized KV cache provided."""

    def make(engine_config: EngineConfig) -> Any:
        container = KVConnectorContainer()
        container.registry.override(providers.Object(registry))
        container.engine_config.override(providers.Object(engine_config))
        container.kv_cache_config.override(providers.Object(kv_cache_config))
        return container

    return make


PLUGIN_SOURCE = """
from tests.support.sample_connectors import HMAConnector, RecordingConnector


class PluginConnector(RecordingConnector):
    pass


class PluginHMAConnector(HMAConnector):
    pass


class OldPluginConnector(RecordingConnector):
    def __init__(self, config, role):
        raise AssertionError("never built")
"""


@pytest.fixture
def plugin_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The name of a fresh, not yet imported module of plugin connectors on ``sys.path``."""
    import sys
    import uuid

    name = f"kvwire_plugin_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
