"""An offload connector's medium, from the container's providers: class, options, context, medium.

The connector is handed its medium built; the registry is entered once per
build for the connector's class and once for its medium's, and a composite's
children are built the same way, through the container's `connector_builder`.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import attrs
import pytest
from dependency_injector import providers

from kvwire.config import KVTransferConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.connectors.offload import CPUOffloadConnector, SharedStorageConnector
from kvwire.container import KVConnectorContainer, container_for_profile
from kvwire.exceptions import ContainerSetupError
from kvwire.factory import KVConnectorFactory
from kvwire.interface.base import KVConnectorBase, KVConnectorRole
from kvwire.media.base import Medium
from kvwire.registry import ConnectorRegistry, MediumRegistry
from kvwire.testing import IdleConnector
from tests.support.pairs import cache_config_for, engine_config

REPO = pathlib.Path(__file__).resolve().parents[2]
POOL = {"cpu_pool_bytes": "1MiB"}

# The offload connectors and their media need the torch extra.
pytestmark = pytest.mark.torch


class CountingMedia(MediumRegistry):
    """Media that note each medium spec looked up."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def get_class(self, spec: str) -> type[Medium]:
        self.asked.append(spec)
        return super().get_class(spec)


class CountingRegistry(ConnectorRegistry):
    """The process's connectors and media, each resolution noted."""

    def __init__(self) -> None:
        super().__init__()
        self.resolved: list[str | None] = []
        self.media: CountingMedia = CountingMedia()

    def resolve(self, kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase]:
        self.resolved.append(kv_transfer_config.kv_connector)
        return super().resolve(kv_transfer_config)


def _container(connector: str, extra: dict[str, Any], registry: ConnectorRegistry) -> Any:
    config = engine_config(connector, extra)
    return container_for_profile(
        config, kv_cache_config=cache_config_for(config), registry=registry
    )


@pytest.mark.parametrize("role", ["scheduler_connector", "worker_connector"])
def test_one_build_resolves_the_connector_class_and_the_medium_once_each(role: str) -> None:
    registry = CountingRegistry()
    container = _container("CPUOffloadConnector", POOL, registry)

    connector = getattr(container, role)()

    assert type(connector) is CPUOffloadConnector
    assert registry.resolved == ["CPUOffloadConnector"]
    assert registry.media.asked == ["cpu_pool"]
    container.shutdown_resources()


def _composite_container(
    tmp_path: pathlib.Path, registry: ConnectorRegistry, *, hma_off: bool = False
) -> Any:
    children = [
        {"kv_connector": "CPUOffloadConnector", "kv_connector_extra_config": POOL},
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        },
    ]
    config = engine_config("MultiConnector", {"connectors": children})
    if hma_off:
        config = attrs.evolve(
            config,
            scheduler_config=attrs.evolve(
                config.scheduler_config, disable_hybrid_kv_cache_manager=True
            ),
        )
    return container_for_profile(
        config, kv_cache_config=cache_config_for(config), registry=registry
    )


def test_each_child_s_build_resolves_its_class_and_its_medium_once(
    tmp_path: pathlib.Path,
) -> None:
    registry = CountingRegistry()
    # HMA off: the gate asks the composite nothing, so what is counted is the builds alone.
    container = _composite_container(tmp_path, registry, hma_off=True)

    multi = container.worker_connector()

    assert [type(child) for child in multi.children] == [
        CPUOffloadConnector,
        SharedStorageConnector,
    ]
    assert registry.resolved == [
        "MultiConnector",
        "CPUOffloadConnector",
        "SharedStorageConnector",
    ]
    assert registry.media.asked == ["cpu_pool", "directory"]
    container.shutdown_resources()


def test_the_hma_gate_asks_each_child_s_class_before_the_composite_is_built(
    tmp_path: pathlib.Path,
) -> None:
    registry = CountingRegistry()
    container = _composite_container(tmp_path, registry)

    container.worker_connector()

    # The gate's question (does every child serve HMA?) comes before the
    # composite's build, which then builds each child, resolving it once.
    assert registry.resolved == [
        "MultiConnector",
        "CPUOffloadConnector",
        "SharedStorageConnector",
        "CPUOffloadConnector",
        "SharedStorageConnector",
    ]
    assert registry.media.asked == ["cpu_pool", "directory"]
    container.shutdown_resources()


def test_each_role_s_connector_gets_a_medium_of_its_own() -> None:
    container = _container("CPUOffloadConnector", POOL, ConnectorRegistry())

    scheduler, worker = container.scheduler_connector(), container.worker_connector()

    assert scheduler.medium is not worker.medium
    assert scheduler.medium.context == worker.medium.context
    container.shutdown_resources()


def test_the_options_and_the_context_are_providers_a_test_overrides() -> None:
    container = _container("CPUOffloadConnector", POOL, ConnectorRegistry())
    options = container.medium_options()
    assert options["cpu_pool_bytes"] == 2**20

    with container.medium_options.override(providers.Object({**options, "async_load": True})):
        scheduler = container.scheduler_connector()

    assert scheduler.medium.context.options["async_load"] is True
    container.shutdown_resources()


def test_an_overridden_medium_is_the_one_the_connector_is_handed() -> None:
    container = _container("CPUOffloadConnector", POOL, ConnectorRegistry())
    built = container.medium()

    with container.medium.override(providers.Object(built)):
        worker = container.worker_connector()

    assert worker.medium is built
    container.shutdown_resources()


def test_an_offload_connector_built_without_its_medium_says_how_to_build_it() -> None:
    config = engine_config("CPUOffloadConnector", POOL)

    with pytest.raises(ContainerSetupError, match=r"KVConnectorContainer .*or pass medium="):
        CPUOffloadConnector(config, KVConnectorRole.WORKER, cache_config_for(config))


def test_an_offload_connector_passed_a_medium_needs_no_container() -> None:
    config = engine_config("CPUOffloadConnector", POOL)
    kv_cache_config: KVCacheConfig = cache_config_for(config)
    container = container_for_profile(config, kv_cache_config=kv_cache_config)

    connector = CPUOffloadConnector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config, medium=container.medium()
    )

    assert connector.medium.context.options["cpu_pool_bytes"] == 2**20
    connector.shutdown()


def test_the_factory_builds_an_offload_connector_over_its_medium() -> None:
    config = engine_config("CPUOffloadConnector", POOL)

    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.WORKER, cache_config_for(config)
    )

    assert type(connector) is CPUOffloadConnector
    assert type(connector.medium).__name__ == "CPUPoolMedium"
    connector.shutdown()


def test_the_child_builder_is_a_provider_a_composite_is_handed(tmp_path: pathlib.Path) -> None:
    built: list[str] = []
    container = _container(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "CPUOffloadConnector", "kv_connector_extra_config": POOL}
            ]
        },
        ConnectorRegistry(),
    )
    build = container.connector_builder()

    def noting(config: Any, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> Any:
        built.append(str(config.kv_transfer_config.kv_connector))
        return build(config, role, kv_cache_config)

    with container.connector_builder.override(providers.Object(noting)):
        container.scheduler_connector()

    assert built == ["CPUOffloadConnector"]
    container.shutdown_resources()


def test_the_medium_section_s_override_example_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REPO / "docs" / "container.md").read_text()
    blocks = [
        block
        for block in re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
        if "container.medium_class.override" in block and "CountingPool" in block
    ]
    assert len(blocks) == 1
    monkeypatch.chdir(REPO)
    namespace: dict[str, object] = {}

    exec(compile(blocks[0], "docs/container.md medium example", "exec"), namespace)

    assert type(namespace["worker_connector"]).__name__ == "CPUOffloadConnector"


def test_the_container_s_medium_class_is_none_for_a_connector_without_one() -> None:
    container = KVConnectorContainer()
    container.engine_config.override(
        providers.Object(engine_config("MultiConnector", {"connectors": [{"kv_connector": "X"}]}))
    )

    assert container.medium_class() is None
    assert container.medium_options() is None


class MediumTakingConnector(IdleConnector):
    """Takes a keyword-only medium but not the classmethods that build one."""

    def __init__(
        self,
        config: Any,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        medium: Medium | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)


def test_a_connector_taking_a_medium_without_the_methods_to_build_it_is_refused() -> None:
    container = _container("CPUOffloadConnector", POOL, ConnectorRegistry())

    with (
        container.connector_class.override(providers.Object(MediumTakingConnector)),
        pytest.raises(ContainerSetupError) as refused,
    ):
        container.worker_connector()

    assert str(refused.value) == (
        "MediumTakingConnector takes a keyword-only medium, but has no medium_spec classmethod "
        "to build it with: derive it from kvwire.connectors.offload.OffloadConnector"
    )


def test_the_refusal_names_the_first_method_the_build_lacks() -> None:
    class WithSpecOnly(MediumTakingConnector):
        @classmethod
        def medium_spec(cls, kv_transfer_config: KVTransferConfig) -> str:
            return "cpu_pool"

    container = _container("CPUOffloadConnector", POOL, ConnectorRegistry())

    with (
        container.connector_class.override(providers.Object(WithSpecOnly)),
        pytest.raises(ContainerSetupError, match=r"^WithSpecOnly .* has no read_options "),
    ):
        container.worker_connector()
