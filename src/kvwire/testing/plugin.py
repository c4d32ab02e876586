"""kvwire's pytest plugin (entry point `pytest11`): options and fixtures of the kit.

Loaded by pytest in every project that has kvwire installed, so it imports
nothing heavy: the engine (and torch) is imported only by the tests that use
it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvwire.container import KVConnectorContainer
    from kvwire.registry import ConnectorRegistry
    from kvwire.testing.instruments import Instruments

ContainerFactory = Callable[..., "KVConnectorContainer"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvwire", "kvwire connector conformance kit")
    group.addoption(
        "--kvwire-no-strict-roles",
        action="store_true",
        default=False,
        help="let a connector answer calls of the other role (strict roles are on by default)",
    )


@pytest.fixture
def kvwire_strict_roles(request: pytest.FixtureRequest) -> bool:
    """Whether connectors under test fail loudly when asked a question of the other role."""
    return not request.config.getoption("--kvwire-no-strict-roles")


@pytest.fixture
def kvwire_instruments(kvwire_strict_roles: bool) -> Instruments:
    """The connector hook the kit hands to the engine: strict roles, no call log."""
    from kvwire.testing.instruments import Instruments

    return Instruments(strict_roles=kvwire_strict_roles)


@pytest.fixture
def kvwire_container() -> Iterator[ContainerFactory]:
    """A factory of containers whose KV cache is sized: `kvwire_container("cpu-offload")`.

    Called with a profile (a shipped name, a YAML path or a mapping) and,
    optionally, `num_blocks` (default: the profile's `num_gpu_blocks`) and
    `registry`, it returns a `KVConnectorContainer` whose `kv_cache_config`
    is the layout kvwire's engine gives that profile's model (one group, or
    a hybrid model's groups when the HMA gate keeps HMA on): override any
    provider, then ask for `scheduler_connector()` or `worker_connector()`.
    Each container's resources are shut down when the test ends.
    """
    built: list[KVConnectorContainer] = []

    def sized(
        profile: str | os.PathLike[str] | Mapping[str, Any],
        *,
        num_blocks: int | None = None,
        registry: ConnectorRegistry | None = None,
    ) -> KVConnectorContainer:
        import attrs

        from kvwire.config.kv_cache import build_kv_cache_config
        from kvwire.container import container_for_profile

        container = container_for_profile(profile, registry=registry)
        built.append(container)
        config = container.engine_config()
        if num_blocks is not None:
            cache = attrs.evolve(config.cache_config, num_gpu_blocks=num_blocks)
            config = attrs.evolve(config, cache_config=cache)
        hma_enabled = container.hma_gate().enabled if config.kv_transfer_config else False
        container.kv_cache_config.override(build_kv_cache_config(config, hma_enabled))
        return container

    yield sized
    for container in reversed(built):
        container.shutdown_resources()
