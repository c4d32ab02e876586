"""A composite's children: each built by a ConnectorSetupContainer and a MediumContainer of its own.

What reaches a child from the container: its registry (and the overrides on
it), the sized cache, and the engine config the composite hands it (the HMA
gate's decision and this rank's parallel layout). The overrides of the
container's medium steps are its own connector's: a child's medium is built
from the child's options.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import attrs
import pytest
from dependency_injector import providers
from dependency_injector.wiring import Provide, inject

from kvwire.config import ParallelConfig
from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.container import (
    ConnectorSetupContainer,
    KVConnectorContainer,
    MediumContainer,
    container_for_profile,
)
from kvwire.exceptions import ContainerSetupError
from kvwire.hma import HMADecision
from kvwire.media.base import Medium
from kvwire.registry import ConnectorRegistry, default_registry
from tests.support.pairs import cache_config_for, engine_config

POOL = {"cpu_pool_bytes": "1MiB"}

# The offload connectors and their media need the torch extra.
pytestmark = pytest.mark.torch


def _children(tmp_path: pathlib.Path) -> list[dict[str, Any]]:
    return [
        {"kv_connector": "CPUOffloadConnector", "kv_connector_extra_config": POOL},
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        },
    ]


def _multi_container(tmp_path: pathlib.Path, registry: ConnectorRegistry | None = None) -> Any:
    config = engine_config("MultiConnector", {"connectors": _children(tmp_path)})
    return container_for_profile(
        config,
        kv_cache_config=cache_config_for(config),
        registry=registry or default_registry().copy(),
    )


def test_the_container_composes_its_setup_and_medium_sub_containers() -> None:
    container = KVConnectorContainer()

    assert container.hma_gate is container.connector_setup.hma_gate
    assert container.parallel_config is container.connector_setup.parallel_config
    assert container.medium_class is container.connector_setup.medium_class
    assert container.medium_options is container.media.medium_options
    assert container.medium is container.media.medium
    assert container.connector_setup().declarative_parent is ConnectorSetupContainer
    assert container.media().declarative_parent is MediumContainer


@inject
def medium_class_of_wired_code(
    medium_class: type[Medium] = Provide[KVConnectorContainer.medium_class],
) -> type[Medium]:
    return medium_class


def test_wired_code_gets_a_step_of_a_sub_container() -> None:
    config = engine_config("CPUOffloadConnector", POOL)
    container = container_for_profile(config)
    container.wire(modules=[sys.modules[__name__]])
    try:
        assert medium_class_of_wired_code().__name__ == "CPUPoolMedium"
    finally:
        container.unwire()


def test_an_override_of_a_medium_step_is_the_container_s_connector_s_not_a_child_s(
    tmp_path: pathlib.Path,
) -> None:
    container = _multi_container(tmp_path)
    pool = default_registry().media.get_class("cpu_pool")

    class OtherPool(pool):  # type: ignore[misc, valid-type]
        """A pool no child names."""

    with (
        container.medium_class.override(providers.Object(OtherPool)),
        container.medium_options.override(providers.Object({"async_load": True})),
    ):
        multi = container.worker_connector()

    cpu_child, storage_child = multi.children
    assert type(cpu_child.medium) is pool
    assert cpu_child.medium.context.options["async_load"] is False
    assert type(storage_child.medium).__name__ == "DirectoryMedium"
    assert storage_child.medium.context.options["shared_storage_path"] == str(tmp_path)
    container.shutdown_resources()


def test_an_override_on_the_container_s_registry_reaches_each_child(
    tmp_path: pathlib.Path,
) -> None:
    registry = default_registry().copy()
    directory = registry.media.get_class("directory")

    class CountingDirectory(directory):  # type: ignore[misc, valid-type]
        """The profile's directory, counting the media built."""

        built = 0

        def __init__(self, context: Any) -> None:
            super().__init__(context)
            CountingDirectory.built += 1

    container = _multi_container(tmp_path, registry)

    with registry.media.provider("directory").override(providers.Object(CountingDirectory)):
        scheduler_side = container.scheduler_connector()
        worker_side = container.worker_connector()

    assert type(scheduler_side.children[1].medium) is CountingDirectory
    assert type(worker_side.children[1].medium) is CountingDirectory
    assert CountingDirectory.built == 2
    container.shutdown_resources()


def test_each_child_gets_the_composite_s_parallel_layout_and_hma_decision(
    tmp_path: pathlib.Path,
) -> None:
    config = engine_config("MultiConnector", {"connectors": _children(tmp_path)})
    rank_one = ParallelConfig(tensor_parallel_size=2, rank=1)
    # The cache of rank 1, which holds half the KV heads.
    rank_cache = cache_config_for(attrs.evolve(config, parallel_config=rank_one))
    container = container_for_profile(config, kv_cache_config=rank_cache)

    with (
        container.parallel_config.override(providers.Object(rank_one)),
        container.hma_gate.override(providers.Object(HMADecision(False, "forced by a test"))),
    ):
        multi = container.worker_connector()

    for child in multi.children:
        assert child.engine_config.parallel_config == rank_one
        assert child.engine_config.scheduler_config.disable_hybrid_kv_cache_manager is True
        assert child.medium.context.parallel == rank_one
    container.shutdown_resources()


def test_children_of_one_class_get_media_of_their_own(tmp_path: pathlib.Path) -> None:
    children = [
        {"kv_connector": "CPUOffloadConnector", "kv_connector_extra_config": POOL},
        {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_extra_config": {"cpu_pool_bytes": "2MiB"},
        },
    ]
    config = engine_config("MultiConnector", {"connectors": children})
    container = container_for_profile(config, kv_cache_config=cache_config_for(config))

    multi = container.scheduler_connector()

    first, second = (child.medium for child in multi.children)
    assert isinstance(first, Medium) and first is not second
    assert [first.context.options["cpu_pool_bytes"], second.context.options["cpu_pool_bytes"]] == [
        2**20,
        2 * 2**20,
    ]
    assert all(type(child) is CPUOffloadConnector for child in multi.children)
    container.shutdown_resources()


def test_a_connector_builder_override_builds_the_children(tmp_path: pathlib.Path) -> None:
    container = _multi_container(tmp_path)
    build = container.connector_builder()
    built: list[type] = []

    def noting(config: Any, role: Any, kv_cache_config: Any) -> Any:
        child = build(config, role, kv_cache_config)
        built.append(type(child))
        return child

    with container.connector_builder.override(providers.Object(noting)):
        container.worker_connector()

    assert built == [CPUOffloadConnector, SharedStorageConnector]
    container.shutdown_resources()


def test_the_sub_containers_stay_fed_after_reset_override() -> None:
    config = engine_config("CPUOffloadConnector", POOL)
    container = container_for_profile(config, kv_cache_config=cache_config_for(config))

    container.reset_override()
    container.engine_config.override(providers.Object(config))
    container.kv_cache_config.override(providers.Object(cache_config_for(config)))

    assert container.medium_class().__name__ == "CPUPoolMedium"
    assert container.medium_options()["cpu_pool_bytes"] == 2**20
    assert type(container.worker_connector()) is CPUOffloadConnector
    container.shutdown_resources()


def test_the_medium_steps_alone_say_the_cache_is_not_sized() -> None:
    container = KVConnectorContainer()
    container.engine_config.override(providers.Object(engine_config("CPUOffloadConnector", POOL)))

    with pytest.raises(ContainerSetupError, match=r"^kv_cache_config is not set: call container"):
        container.medium_context()


def test_a_child_s_medium_is_built_with_the_engine_config_the_composite_hands_it(
    tmp_path: pathlib.Path,
) -> None:
    container = _multi_container(tmp_path)
    parent_config = container.connector_engine_config()

    multi = container.scheduler_connector()

    cpu_child = multi.children[0]
    assert cpu_child.engine_config == attrs.evolve(
        parent_config, kv_transfer_config=cpu_child.kv_transfer_config
    )
    container.shutdown_resources()


def test_override_providers_reaches_the_steps_of_the_sub_containers() -> None:
    config = engine_config("CPUOffloadConnector", POOL)
    container = container_for_profile(config, kv_cache_config=cache_config_for(config))
    options = container.medium_options()
    forced = HMADecision(False, "forced by a test")

    with container.override_providers(
        hma_gate=providers.Object(forced),
        medium_options=providers.Object({**options, "async_load": True}),
    ):
        assert container.connector_setup.hma_gate() is forced
        scheduler_side = container.scheduler_connector()

    assert scheduler_side.engine_config.scheduler_config.disable_hybrid_kv_cache_manager is True
    assert scheduler_side.medium.context.options["async_load"] is True
    assert container.hma_gate() is not forced
    container.shutdown_resources()
