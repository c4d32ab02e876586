"""The HMA gate over every kind of connector and every setting of the switch.

Rows: an HMA connector, a non-HMA one, composites of HMA children, of mixed
children, a subclass of a composite (mixed children: it must not skip the
check by having another name), and a composite with no children. Columns:
``disable_hybrid_kv_cache_manager`` = True / False / None. Each cell is
checked through the container's gate, through building a connector, and
through vLLM's API ``KVConnectorFactory``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig
from kvwire.factory import KVConnectorFactory
from kvwire.interface.base import KVConnectorRole
from kvwire.registry import ConnectorRegistry
from tests.support.connectors import SAMPLES

HMA_CHILD = {"kv_connector": "HMAConnector"}
NON_HMA_CHILD = {"kv_connector": "RecordingConnector"}

# name -> (kv_connector, children or None, supports HMA)
CONNECTORS: dict[str, tuple[str, list[dict[str, str]] | None, bool]] = {
    "hma": ("HMAConnector", None, True),
    "non-hma": ("RecordingConnector", None, False),
    "composite[hma,hma]": ("CompositeConnector", [HMA_CHILD, HMA_CHILD], True),
    "composite[hma,non-hma]": ("CompositeConnector", [HMA_CHILD, NON_HMA_CHILD], False),
    "composite-subclass[hma,non-hma]": ("CompositeSubclass", [HMA_CHILD, NON_HMA_CHILD], False),
    "composite-subclass[hma,hma]": ("CompositeSubclass", [HMA_CHILD, HMA_CHILD], True),
    "composite[]": ("CompositeConnector", [], False),
}
SWITCH = {"disable=True": True, "disable=False": False, "disable=None": None}

CELLS: dict[str, tuple[str, bool | None]] = {
    f"{connector}-{setting}": (connector, disable)
    for connector in CONNECTORS
    for setting, disable in SWITCH.items()
}
MATRIX = [pytest.param(*cell, id=cell_id) for cell_id, cell in CELLS.items()]


def config_for(
    make_engine_config: Callable[..., EngineConfig],
    connector: str,
    disable: bool | None,
    *,
    by_module_path: bool = False,
) -> EngineConfig:
    """The matrix cell's config; ``by_module_path`` names every class by module path.

    The factory serves the process-wide registry, which the tests leave alone:
    a module path reaches the sample connectors without registering them.
    """
    name, children, _ = CONNECTORS[connector]
    located = {"kv_connector_module_path": SAMPLES} if by_module_path else {}
    extra = {} if children is None else {"connectors": [{**c, **located} for c in children]}
    return make_engine_config(name, disable_hma=disable, kv_connector_extra_config=extra, **located)


def expected_enabled(connector: str, disable: bool | None) -> bool | None:
    """True/False for the decision, None for the error."""
    supported = CONNECTORS[connector][2]
    if disable is True:
        return False
    if disable is False:
        return True if supported else None
    return supported


@attrs.frozen
class GateCell:
    """One cell of the matrix in a container: the row's connector name and the expected decision."""

    connector_name: str
    container: Any
    expected: bool | None


@pytest.fixture(params=list(CELLS.values()), ids=list(CELLS))
def cell(
    request: pytest.FixtureRequest,
    make_engine_config: Callable[..., EngineConfig],
    make_container: Callable[[EngineConfig], Any],
) -> GateCell:
    connector, disable = request.param
    return GateCell(
        connector_name=CONNECTORS[connector][0],
        container=make_container(config_for(make_engine_config, connector, disable)),
        expected=expected_enabled(connector, disable),
    )


def test_the_gate_decides_as_the_reference(cell: GateCell) -> None:
    container, expected = cell.container, cell.expected

    if expected is None:
        name = cell.connector_name
        with pytest.raises(ValueError) as caught:
            container.hma_gate()
        assert str(caught.value) == (
            f"Connector {name} does not support HMA but HMA is enabled. "
            "Please set `--disable-hybrid-kv-cache-manager`."
        )
    else:
        assert container.hma_gate().enabled is expected


def test_building_a_connector_applies_the_gate(cell: GateCell) -> None:
    container, expected = cell.container, cell.expected

    if expected is None:
        with pytest.raises(ValueError, match="does not support HMA but HMA is enabled"):
            container.worker_connector()
    else:
        built = container.worker_connector()
        # The connector sees the decision, never "auto".
        assert built.engine_config.scheduler_config.disable_hybrid_kv_cache_manager is (
            not expected
        )
        container.shutdown_resources()


@pytest.mark.parametrize(("connector", "disable"), MATRIX)
def test_the_factory_applies_the_same_gate(
    connector: str,
    disable: bool | None,
    make_engine_config: Callable[..., EngineConfig],
    kv_cache_config: KVCacheConfig,
) -> None:
    config = config_for(make_engine_config, connector, disable, by_module_path=True)
    assert config.kv_transfer_config is not None
    expected = expected_enabled(connector, disable)

    supported = KVConnectorFactory.supports_hma_config(config.kv_transfer_config)

    assert supported is CONNECTORS[connector][2]
    if expected is None:
        with pytest.raises(ValueError, match="does not support HMA but HMA is enabled"):
            KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    else:
        built = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, kv_cache_config
        )
        assert built.role is KVConnectorRole.SCHEDULER
        built.shutdown()


def test_auto_mode_logs_its_decision(
    make_engine_config: Callable[..., EngineConfig],
    make_container: Callable[[EngineConfig], Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    container = make_container(config_for(make_engine_config, "non-hma", None))

    with caplog.at_level(logging.INFO, logger="kvwire.hma"):
        container.hma_gate()

    assert caplog.records[0].getMessage() == (
        "HMA gate: disable_hybrid_kv_cache_manager is unset and RecordingConnector does not "
        "support HMA: HMA is turned off"
    )


def test_disabling_hma_never_asks_the_connector(
    make_engine_config: Callable[..., EngineConfig],
    make_container: Callable[[EngineConfig], Any],
    registry: ConnectorRegistry,
) -> None:
    # The child cannot even be resolved: asking about it would fail.
    config = make_engine_config(
        "CompositeConnector",
        disable_hma=True,
        kv_connector_extra_config={"connectors": [{"kv_connector": "Unknown"}]},
    )

    assert make_container(config).hma_gate().enabled is False


def test_a_child_that_cannot_be_resolved_fails_the_gate_with_its_error(
    make_engine_config: Callable[..., EngineConfig],
    make_container: Callable[[EngineConfig], Any],
) -> None:
    config = make_engine_config(
        "CompositeConnector",
        disable_hma=None,
        kv_connector_extra_config={"connectors": [{"kv_connector": "Unknown"}]},
    )

    with pytest.raises(ValueError, match=r"^Unsupported connector type: Unknown;"):
        make_container(config).hma_gate()
