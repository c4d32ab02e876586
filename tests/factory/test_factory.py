"""``KVConnectorFactory``: vLLM's API and messages, on kvwire's one registry."""

from __future__ import annotations

import logging
import sys
import uuid

import pytest

from kvwire import KVConnectorFactory
from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.interface.base import KVConnectorRole
from kvwire.registry import default_registry
from tests.support.connectors import SAMPLES, CompositeConnector, HMAConnector, RecordingConnector


def sample(name: str, **fields: object) -> KVTransferConfig:
    """A config naming a sample connector by module path (the shared registry stays clean)."""
    located: dict[str, object] = {"kv_connector_module_path": SAMPLES, **fields}
    return KVTransferConfig(kv_connector=name, kv_role="kv_both", **located)  # type: ignore[arg-type]


def test_registering_through_the_factory_fills_the_shared_registry(plugin_module: str) -> None:
    name = f"Plugin{uuid.uuid4().hex}"

    KVConnectorFactory.register_connector(name, plugin_module, "PluginConnector")

    assert name in default_registry()
    assert plugin_module not in sys.modules
    resolved = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector=name, kv_role="kv_both")
    )
    assert resolved is sys.modules[plugin_module].PluginConnector


def test_registering_a_built_in_name_through_the_factory_is_an_error() -> None:
    with pytest.raises(ValueError) as caught:
        KVConnectorFactory.register_connector("CPUOffloadConnector", "anywhere", "Anything")

    assert str(caught.value) == "Connector 'CPUOffloadConnector' is already registered."


def test_get_connector_class_keeps_the_reference_errors() -> None:
    with pytest.raises(ValueError, match=r"^Connector name is not set in KVTransferConfig$"):
        KVConnectorFactory.get_connector_class(KVTransferConfig())
    with pytest.raises(
        ValueError, match=r"^Unsupported connector type: NoSuchConnector; known connectors: "
    ):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="NoSuchConnector", kv_role="kv_both")
        )
    with pytest.raises(ValueError, match=r"^kv_connector_module_path cannot be an empty string\.$"):
        KVConnectorFactory.get_connector_class(sample("X", kv_connector_module_path=""))


def test_get_connector_class_by_module_path() -> None:
    assert KVConnectorFactory.get_connector_class(sample("HMAConnector")) is HMAConnector


def test_create_connector_needs_a_kv_transfer_config(kv_cache_config: KVCacheConfig) -> None:
    with pytest.raises(ValueError) as caught:
        KVConnectorFactory.create_connector(EngineConfig(), KVConnectorRole.WORKER, kv_cache_config)

    assert str(caught.value) == "kv_transfer_config must be set to create a connector"


def test_create_connector_builds_the_role_and_logs_name_and_engine_id(
    kv_cache_config: KVCacheConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = EngineConfig(kv_transfer_config=sample("RecordingConnector", engine_id="engine-7"))

    with caplog.at_level(logging.INFO, logger="kvwire.registry"):
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )

    assert type(connector) is RecordingConnector
    assert connector.role is KVConnectorRole.WORKER
    assert connector.kv_cache_config is kv_cache_config
    assert "Creating v1 connector with name: RecordingConnector and engine_id: engine-7" in [
        record.getMessage() for record in caplog.records
    ]


def test_each_create_connector_call_builds_a_new_connector(kv_cache_config: KVCacheConfig) -> None:
    config = EngineConfig(kv_transfer_config=sample("RecordingConnector"))

    first = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    second = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)

    assert first is not second


def test_the_caller_owns_a_factory_built_connector(kv_cache_config: KVCacheConfig) -> None:
    import gc

    config = EngineConfig(kv_transfer_config=sample("RecordingConnector"))
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    gc.collect()

    assert connector.shutdown_count == 0  # type: ignore[attr-defined]


def test_create_connector_hands_a_composite_its_builder(kv_cache_config: KVCacheConfig) -> None:
    children = [{"kv_connector": "HMAConnector", "kv_connector_module_path": SAMPLES}]
    config = EngineConfig(
        kv_transfer_config=sample(
            "CompositeConnector", kv_connector_extra_config={"connectors": children}
        )
    )

    composite = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)

    assert isinstance(composite, CompositeConnector)
    assert [type(child) for child in composite.children] == [HMAConnector]


def test_get_connector_class_by_name_finds_a_registered_connector(plugin_module: str) -> None:
    name = f"Plugin{uuid.uuid4().hex}"
    KVConnectorFactory.register_connector(name, plugin_module, "PluginConnector")

    found = KVConnectorFactory.get_connector_class_by_name(name)

    assert found is sys.modules[plugin_module].PluginConnector


def test_get_connector_class_by_name_of_an_unknown_name_keeps_the_reference_error() -> None:
    with pytest.raises(ValueError) as caught:
        KVConnectorFactory.get_connector_class_by_name("NoSuchConnector")

    assert str(caught.value) == "Connector 'NoSuchConnector' is not registered."


def test_get_connector_class_by_name_finds_a_class_found_by_module_path_before() -> None:
    resolved = KVConnectorFactory.get_connector_class(sample("VarKeywordConnector"))

    assert KVConnectorFactory.get_connector_class_by_name("VarKeywordConnector") is resolved
