"""The container: role-scoped connectors, the process's connector, overrides, wiring, shutdown."""

from __future__ import annotations

import logging
import pathlib
import sys
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from dependency_injector import providers
from dependency_injector.wiring import Provide, inject

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig, build_full_attention_kv_cache_config
from kvwire.container import KVConnectorContainer, container_for_profile, declare_role
from kvwire.exceptions import ContainerSetupError, NotAConnectorError, ProfileError
from kvwire.hma import HMADecision
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.registry import ConnectorRegistry, default_registry
from tests.support.connectors import (
    SAMPLES,
    CompositeConnector,
    HMAConnector,
    RecordingConnector,
)

MakeContainer = Callable[[EngineConfig], Any]
MakeEngineConfig = Callable[..., EngineConfig]


@pytest.fixture
def container(make_container: MakeContainer, make_engine_config: MakeEngineConfig) -> Any:
    built = make_container(make_engine_config("RecordingConnector"))
    yield built
    built.shutdown_resources()


def test_each_role_gets_its_own_connector_built_with_that_role(container: Any) -> None:
    scheduler_side = container.scheduler_connector()
    worker_side = container.worker_connector()

    assert isinstance(scheduler_side, RecordingConnector)
    assert scheduler_side is not worker_side
    assert scheduler_side.role is KVConnectorRole.SCHEDULER
    assert worker_side.role is KVConnectorRole.WORKER


def test_a_container_builds_one_connector_per_role(container: Any) -> None:
    assert container.worker_connector() is container.worker_connector()
    assert container.scheduler_connector() is container.scheduler_connector()


def test_two_containers_never_share_a_connector(
    make_container: MakeContainer, make_engine_config: MakeEngineConfig
) -> None:
    config = make_engine_config("RecordingConnector")
    first, second = make_container(config), make_container(config)

    assert first.worker_connector() is not second.worker_connector()


def test_a_connector_receives_the_config_role_and_sized_cache(
    container: Any, kv_cache_config: KVCacheConfig
) -> None:
    worker_side = container.worker_connector()

    assert worker_side.kv_cache_config is kv_cache_config
    assert worker_side.kv_transfer_config is container.engine_config().kv_transfer_config


def test_shutting_down_resources_shuts_down_each_built_connector_once(container: Any) -> None:
    scheduler_side = container.scheduler_connector()
    worker_side = container.worker_connector()

    container.shutdown_resources()

    assert scheduler_side.shutdown_count == 1
    assert worker_side.shutdown_count == 1


def test_shutting_down_leaves_an_unbuilt_role_unbuilt(container: Any) -> None:
    worker_side = container.worker_connector()

    container.shutdown_resources()

    assert worker_side.events == ["shutdown"]
    assert not container.scheduler_connector.initialized


def test_the_process_connector_follows_the_declared_role(container: Any) -> None:
    declare_role(container, KVConnectorRole.WORKER)

    assert container.connector() is container.worker_connector()


def test_a_scheduler_process_gets_the_scheduler_connector(container: Any) -> None:
    declare_role(container, KVConnectorRole.SCHEDULER)

    assert container.connector().role is KVConnectorRole.SCHEDULER


def test_asking_for_the_process_connector_before_declaring_a_role_is_an_error(
    container: Any,
) -> None:
    with pytest.raises(ContainerSetupError) as caught:
        container.connector()

    assert str(caught.value) == (
        "This process's connector role is not set: declare it once with "
        "kvwire.container.declare_role(container, KVConnectorRole.WORKER) (or SCHEDULER)"
    )


def test_declaring_something_that_is_not_a_role_is_an_error(container: Any) -> None:
    with pytest.raises(TypeError) as caught:
        declare_role(container, "worker")  # type: ignore[arg-type]

    assert str(caught.value) == (
        "role must be a KVConnectorRole (SCHEDULER or WORKER), got 'worker'"
    )


def test_building_before_the_cache_is_sized_is_an_error(
    registry: ConnectorRegistry, make_engine_config: MakeEngineConfig
) -> None:
    container = KVConnectorContainer()
    container.registry.override(providers.Object(registry))
    container.engine_config.override(providers.Object(make_engine_config("RecordingConnector")))

    with pytest.raises(ContainerSetupError) as caught:
        container.worker_connector()

    assert str(caught.value) == (
        "kv_cache_config is not set: call container.kv_cache_config.override(kv_cache_config) "
        "once the engine has sized its KV cache"
    )


def test_a_kv_cache_config_of_the_wrong_type_is_refused(container: Any) -> None:
    with (
        container.kv_cache_config.override(providers.Object({"num_blocks": 4})),
        pytest.raises(Exception, match="is not an instance of"),
    ):
        container.worker_connector()


def test_a_config_without_kv_transfer_config_cannot_build_a_connector(
    make_container: MakeContainer,
) -> None:
    container = make_container(EngineConfig())

    with pytest.raises(ValueError) as caught:
        container.worker_connector()

    assert str(caught.value) == "kv_transfer_config must be set to create a connector"


def from_profile_mapping(
    registry: ConnectorRegistry, kv_cache_config: KVCacheConfig, kv_transfer_config: dict[str, str]
) -> Any:
    """A container on the private registry whose engine config comes from a profile mapping."""
    container = KVConnectorContainer()
    container.registry.override(providers.Object(registry))
    container.kv_cache_config.override(providers.Object(kv_cache_config))
    container.config.from_dict({"kv_transfer_config": kv_transfer_config})
    return container


def test_the_engine_config_comes_from_the_profile_mapping(
    registry: ConnectorRegistry, kv_cache_config: KVCacheConfig
) -> None:
    container = from_profile_mapping(
        registry, kv_cache_config, {"kv_connector": "HMAConnector", "kv_role": "kv_consumer"}
    )

    assert isinstance(container.worker_connector(), HMAConnector)
    assert container.engine_config().kv_transfer_config.kv_role == "kv_consumer"


def test_a_bad_profile_in_the_config_provider_is_a_profile_error() -> None:
    container = KVConnectorContainer()
    container.config.from_dict({"kv_transfer_config": {"kv_role": "producer"}})

    with pytest.raises(
        ProfileError, match=r"kv_transfer_config\.kv_role: .producer. is not one of"
    ):
        container.engine_config()


def test_both_roles_share_one_engine_id(
    registry: ConnectorRegistry, kv_cache_config: KVCacheConfig
) -> None:
    container = from_profile_mapping(
        registry, kv_cache_config, {"kv_connector": "RecordingConnector", "kv_role": "kv_both"}
    )

    assert (
        container.worker_connector().kv_transfer_config.engine_id
        == container.scheduler_connector().kv_transfer_config.engine_id
    )


def test_container_for_profile_validates_and_declares(
    make_engine_config: MakeEngineConfig, kv_cache_config: KVCacheConfig
) -> None:
    config = make_engine_config("RecordingConnector")

    container = container_for_profile(
        config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    )

    assert container.engine_config() is config
    assert container.process_role() is KVConnectorRole.WORKER


PROFILE = {
    "kv_transfer_config": {"kv_connector": "RecordingConnector", "kv_role": "kv_both"},
}


def profile_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "profile.yaml"
    path.write_text("kv_transfer_config:\n  kv_connector: RecordingConnector\n  kv_role: kv_both\n")
    return path


@pytest.mark.parametrize("source", ["mapping", "file"])
def test_an_override_of_a_config_option_after_container_for_profile_takes_effect(
    source: str,
    tmp_path: pathlib.Path,
    registry: ConnectorRegistry,
    kv_cache_config: KVCacheConfig,
) -> None:
    profile = PROFILE if source == "mapping" else profile_file(tmp_path)
    container = container_for_profile(profile, kv_cache_config=kv_cache_config, registry=registry)

    with container.config.kv_transfer_config.kv_connector.override("HMAConnector"):
        assert container.engine_config().kv_transfer_config.kv_connector == "HMAConnector"
        assert container.connector_class() is HMAConnector
        assert isinstance(container.worker_connector(), HMAConnector)
    container.shutdown_resources()

    assert container.connector_class() is RecordingConnector
    assert isinstance(container.worker_connector(), RecordingConnector)
    container.shutdown_resources()


def test_a_profile_file_container_for_profile_refuses_is_named_in_the_error(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "profile.yaml"
    path.write_text("kv_transfer_config:\n  kv_conector: RecordingConnector\n")

    with pytest.raises(ProfileError) as refused:
        container_for_profile(path)

    assert str(path) in str(refused.value)
    assert "kv_conector" in str(refused.value)


# ----------------------------------------------------------------- overrides


def test_overriding_the_connector_class_lasts_until_the_block_ends(container: Any) -> None:
    with container.connector_class.override(providers.Object(HMAConnector)):
        assert container.connector_class() is HMAConnector

    assert container.connector_class() is RecordingConnector


def test_an_overriding_class_builds_the_connectors(container: Any) -> None:
    with container.connector_class.override(providers.Object(HMAConnector)):
        assert isinstance(container.worker_connector(), HMAConnector)


class NotAConnector:
    """What a test might write by mistake: a class with a connector's methods, no base."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False


@pytest.mark.parametrize("provided", [NotAConnector, NotAConnector(), "RecordingConnector"])
@pytest.mark.parametrize("asked", ["worker_connector", "scheduler_connector", "hma_gate"])
def test_an_override_of_the_connector_class_that_is_no_connector_class_is_refused(
    container: Any, provided: object, asked: str
) -> None:
    with container.connector_class.override(provided), pytest.raises(NotAConnectorError) as refused:
        getattr(container, asked)()

    message = str(refused.value)
    assert message.startswith("KVConnectorContainer.connector_class provides ")
    assert "subclass of kvwire.KVConnectorBase" in message
    assert "kvwire.testing.IdleConnector" in message
    # Undone with the block: the configured class builds again.
    assert isinstance(container.worker_connector(), RecordingConnector)


def test_overriding_one_registry_entry_reaches_the_container(
    container: Any, registry: ConnectorRegistry
) -> None:
    with registry.provider("RecordingConnector").override(providers.Object(HMAConnector)):
        assert container.connector_class() is HMAConnector

    assert container.connector_class() is RecordingConnector


def test_overriding_the_hma_gate_lasts_until_the_block_ends(
    make_container: MakeContainer, make_engine_config: MakeEngineConfig
) -> None:
    container = make_container(make_engine_config("RecordingConnector", disable_hma=False))
    forced = HMADecision(enabled=True, reason="forced by the test")

    with container.hma_gate.override(providers.Object(forced)):
        assert container.hma_gate() is forced
        assert isinstance(container.worker_connector(), RecordingConnector)

    with pytest.raises(ValueError, match="does not support HMA"):
        container.hma_gate()


def test_overriding_kv_cache_config_lasts_until_the_block_ends(
    container: Any, kv_cache_config: KVCacheConfig
) -> None:
    bigger = build_full_attention_kv_cache_config(
        num_layers=2, num_blocks=64, block_size=4, num_kv_heads=2, head_size=8, dtype="float32"
    )

    with container.kv_cache_config.override(providers.Object(bigger)):
        assert container.kv_cache_config() is bigger

    assert container.kv_cache_config() is kv_cache_config


def test_overriding_the_config_lasts_until_the_block_ends(
    registry: ConnectorRegistry, kv_cache_config: KVCacheConfig
) -> None:
    container = KVConnectorContainer()
    container.registry.override(providers.Object(registry))
    container.config.from_dict(
        {"kv_transfer_config": {"kv_connector": "RecordingConnector", "kv_role": "kv_both"}}
    )
    replacement = {"kv_transfer_config": {"kv_connector": "HMAConnector", "kv_role": "kv_both"}}

    with container.config.override(replacement):
        assert container.connector_class() is HMAConnector

    assert container.connector_class() is RecordingConnector


def test_overriding_the_registry_lasts_until_the_block_ends(container: Any) -> None:
    other = ConnectorRegistry(built_ins={}, entry_point_group=None)
    other.register_connector("RecordingConnector", "tests.support.connectors", "HMAConnector")

    with container.registry.override(providers.Object(other)):
        assert container.connector_class() is HMAConnector

    assert container.connector_class() is RecordingConnector


def test_overriding_a_role_connector_swaps_the_process_connector(container: Any) -> None:
    declare_role(container, KVConnectorRole.WORKER)
    replacement = container.scheduler_connector()

    with container.worker_connector.override(providers.Object(replacement)):
        assert container.connector() is replacement

    assert container.connector().role is KVConnectorRole.WORKER


@pytest.fixture
def shared_name() -> str:
    """A sample connector registered, under a fresh name, in the process-wide registry."""
    name = f"Shared{uuid.uuid4().hex}"
    default_registry().register_connector(name, SAMPLES, "RecordingConnector")
    return name


def test_overriding_an_entry_of_the_default_registry_reaches_every_container(
    shared_name: str, make_engine_config: MakeEngineConfig, kv_cache_config: KVCacheConfig
) -> None:
    config = make_engine_config(shared_name)
    first = container_for_profile(config, kv_cache_config=kv_cache_config)
    second = container_for_profile(config, kv_cache_config=kv_cache_config)

    with default_registry().provider(shared_name).override(providers.Object(HMAConnector)):
        assert first.connector_class() is HMAConnector
        assert second.connector_class() is HMAConnector


def test_an_override_on_a_private_registry_reaches_only_its_container(
    shared_name: str, make_engine_config: MakeEngineConfig, kv_cache_config: KVCacheConfig
) -> None:
    config = make_engine_config(shared_name)
    private = default_registry().copy()
    isolated = container_for_profile(config, kv_cache_config=kv_cache_config, registry=private)
    shared = container_for_profile(config, kv_cache_config=kv_cache_config)

    with private.provider(shared_name).override(providers.Object(HMAConnector)):
        assert isolated.connector_class() is HMAConnector
        assert shared.connector_class() is RecordingConnector


def test_reset_override_also_drops_the_profile_role_cache_and_registry_set_by_override(
    make_engine_config: MakeEngineConfig,
    kv_cache_config: KVCacheConfig,
    registry: ConnectorRegistry,
) -> None:
    container = container_for_profile(
        make_engine_config("RecordingConnector"),
        role=KVConnectorRole.WORKER,
        kv_cache_config=kv_cache_config,
        registry=registry,
    )

    container.reset_override()

    assert not container.engine_config.overridden
    assert not container.process_role.overridden
    assert not container.kv_cache_config.overridden
    assert container.registry() is default_registry()
    with pytest.raises(ContainerSetupError, match="connector role is not set"):
        container.connector()


# ------------------------------------------------------------------- wiring


@inject
def worker_side_of(
    connector: KVConnectorBase = Provide[KVConnectorContainer.worker_connector],
) -> KVConnectorBase:
    return connector


@inject
def this_process_connector(
    connector: KVConnectorBase = Provide[KVConnectorContainer.connector],
) -> KVConnectorBase:
    return connector


def test_wired_code_gets_the_worker_connector(container: Any) -> None:
    container.wire(modules=[sys.modules[__name__]])
    try:
        assert worker_side_of() is container.worker_connector()
    finally:
        container.unwire()


def test_wired_code_gets_the_connector_of_the_declared_role(container: Any) -> None:
    declare_role(container, KVConnectorRole.SCHEDULER)
    container.wire(modules=[sys.modules[__name__]])
    try:
        assert this_process_connector() is container.scheduler_connector()
    finally:
        container.unwire()


def test_unwired_code_gets_the_marker_not_a_connector() -> None:
    assert not isinstance(worker_side_of(), KVConnectorBase)


# --------------------------------------------------------------- composites


def test_a_composite_builds_its_children_through_the_registry(
    make_container: MakeContainer, make_engine_config: MakeEngineConfig
) -> None:
    config = make_engine_config(
        "CompositeConnector",
        kv_connector_extra_config={
            "connectors": [{"kv_connector": "HMAConnector"}, {"kv_connector": "RecordingConnector"}]
        },
    )
    container = make_container(config)

    composite = container.worker_connector()

    assert isinstance(composite, CompositeConnector)
    assert [type(child) for child in composite.children] == [HMAConnector, RecordingConnector]
    assert all(child.role is KVConnectorRole.WORKER for child in composite.children)
    container.shutdown_resources()
    assert [child.shutdown_count for child in composite.children] == [1, 1]


def test_a_composite_child_honours_an_override_of_its_registry_entry(
    make_container: MakeContainer,
    make_engine_config: MakeEngineConfig,
    registry: ConnectorRegistry,
) -> None:
    config = make_engine_config(
        "CompositeConnector",
        disable_hma=True,
        kv_connector_extra_config={"connectors": [{"kv_connector": "RecordingConnector"}]},
    )

    with registry.provider("RecordingConnector").override(providers.Object(HMAConnector)):
        composite = make_container(config).worker_connector()

    assert [type(child) for child in composite.children] == [HMAConnector]


def test_a_composite_child_may_be_loaded_by_module_path(
    make_container: MakeContainer, make_engine_config: MakeEngineConfig, plugin_module: str
) -> None:
    config = make_engine_config(
        "CompositeConnector",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "PluginHMAConnector", "kv_connector_module_path": plugin_module}
            ]
        },
    )

    composite = make_container(config).scheduler_connector()

    assert type(composite.children[0]).__name__ == "PluginHMAConnector"
    assert composite.children[0].kv_transfer_config.engine_id == (
        composite.kv_transfer_config.engine_id
    )


def test_the_hma_gate_logs_its_decision_once_per_role(
    container: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine's log says what the gate decided once for each connector it builds."""
    with caplog.at_level(logging.INFO, logger="kvwire.hma"):
        container.scheduler_connector()
        container.worker_connector()

    gate_lines = [
        record.getMessage() for record in caplog.records if "HMA gate" in record.getMessage()
    ]
    assert len(gate_lines) == 2
