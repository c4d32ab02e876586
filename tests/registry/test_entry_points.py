"""Third-party connectors found through the ``kvwire.connectors`` entry-point group.

Each test puts a distribution's metadata (a ``.dist-info`` folder) on
``sys.path`` in a temporary folder, as ``pip install`` would, without
touching the shared virtual environment.
"""

from __future__ import annotations

import logging
import pathlib
import sys
from collections.abc import Callable

import pytest

from kvwire.config import KVTransferConfig
from kvwire.exceptions import ConnectorEntryPointError
from kvwire.registry import ConnectorRegistry, PluginSource

PluginRegistry = Callable[..., ConnectorRegistry]


@pytest.fixture
def plugin_registry(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> PluginRegistry:
    """A registry (no built-ins unless given) in a process where a distribution is installed.

    Called as ``plugin_registry(entry_points, built_ins={})``: the distribution
    ``kvwire-sample-plugin 1.2`` declares ``entry_points`` (name -> ``module:Class``).
    """

    def registry_with(
        entry_points: dict[str, str], built_ins: dict[str, tuple[str, str]] | None = None
    ) -> ConnectorRegistry:
        dist_info = tmp_path / "site" / "kvwire_sample_plugin-1.2.dist-info"
        dist_info.mkdir(parents=True)
        (dist_info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: kvwire-sample-plugin\nVersion: 1.2\n"
        )
        lines = [f"{name} = {value}" for name, value in entry_points.items()]
        (dist_info / "entry_points.txt").write_text(
            "[kvwire.connectors]\n" + "\n".join(lines) + "\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        return ConnectorRegistry(built_ins=built_ins or {})

    return registry_with


def transfer(name: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role="kv_both")


def test_an_entry_point_is_listed_without_importing_its_module(
    plugin_registry: PluginRegistry, plugin_module: str
) -> None:
    registry = plugin_registry({"Sample": f"{plugin_module}:PluginConnector"})

    (entry,) = registry.entries()

    assert entry.name == "Sample"
    assert entry.source is PluginSource.ENTRY_POINT
    assert entry.distribution == "'kvwire-sample-plugin 1.2'"
    assert plugin_module not in sys.modules


def test_an_entry_point_resolves_to_its_class_on_first_use(
    plugin_registry: PluginRegistry, plugin_module: str
) -> None:
    registry = plugin_registry({"Sample": f"{plugin_module}:PluginHMAConnector"})

    connector_cls = registry.resolve(transfer("Sample"))

    assert connector_cls is sys.modules[plugin_module].PluginHMAConnector
    assert registry.supports_hma_config(transfer("Sample"))


def test_a_broken_entry_point_names_its_distribution_and_itself(
    plugin_registry: PluginRegistry,
) -> None:
    registry = plugin_registry({"Broken": "kvwire_missing_plugin_module:Thing"})

    with pytest.raises(ConnectorEntryPointError) as caught:
        registry.resolve(transfer("Broken"))

    assert str(caught.value) == (
        "The entry point 'Broken = kvwire_missing_plugin_module:Thing' (group "
        "'kvwire.connectors') of distribution 'kvwire-sample-plugin 1.2' cannot be loaded: "
        "ModuleNotFoundError: No module named 'kvwire_missing_plugin_module'"
    )
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_an_entry_point_naming_a_missing_class_names_its_distribution(
    plugin_registry: PluginRegistry, plugin_module: str
) -> None:
    registry = plugin_registry({"Typo": f"{plugin_module}:PluginConector"})

    with pytest.raises(ConnectorEntryPointError) as caught:
        registry.resolve(transfer("Typo"))

    assert str(caught.value) == (
        f"The entry point 'Typo = {plugin_module}:PluginConector' (group 'kvwire.connectors') "
        "of distribution 'kvwire-sample-plugin 1.2' cannot be loaded: AttributeError: module "
        f"'{plugin_module}' has no attribute 'PluginConector'"
    )


def test_an_entry_point_without_a_class_is_malformed(
    plugin_registry: PluginRegistry,
) -> None:
    registry = plugin_registry({"Bare": "some_module"})

    with pytest.raises(ConnectorEntryPointError) as caught:
        registry.resolve(transfer("Bare"))

    assert str(caught.value) == (
        "The entry point 'Bare = some_module:' (group 'kvwire.connectors') of distribution "
        "'kvwire-sample-plugin 1.2' must name a class as 'package.module:Class'"
    )


def test_a_plugin_with_a_two_argument_constructor_fails_at_resolution(
    plugin_registry: PluginRegistry, plugin_module: str
) -> None:
    registry = plugin_registry({"Old": f"{plugin_module}:OldPluginConnector"})

    with pytest.raises(ValueError, match=r"^Connector OldPluginConnector uses deprecated"):
        registry.resolve(transfer("Old"))


def test_an_entry_point_cannot_shadow_a_built_in(
    plugin_registry: PluginRegistry,
    plugin_module: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = plugin_registry(
        {"Shadow": f"{plugin_module}:PluginConnector"},
        built_ins={"Shadow": ("tests.support.connectors", "HMAConnector")},
    )

    with caplog.at_level(logging.WARNING, logger="kvwire.registry"):
        entry = registry.entry("Shadow")

    assert entry.source is PluginSource.BUILT_IN
    assert caplog.records[0].getMessage() == (
        f"Ignoring entry point 'Shadow = {plugin_module}:PluginConnector' of distribution "
        "'kvwire-sample-plugin 1.2': connector 'Shadow' is already registered (built in, "
        "tests.support.connectors:HMAConnector)"
    )


def test_registering_a_name_an_entry_point_declared_is_an_error(
    plugin_registry: PluginRegistry, plugin_module: str
) -> None:
    registry = plugin_registry({"Sample": f"{plugin_module}:PluginConnector"})

    with pytest.raises(ValueError, match=r"^Connector 'Sample' is already registered\.$"):
        registry.register_connector("Sample", "anywhere", "Anything")


def test_an_entry_point_whose_module_calls_sys_exit_is_its_error_redacted(
    plugin_registry: PluginRegistry,
) -> None:
    registry = plugin_registry({"Exiting": "tests.support.plugin_modules.exiting:Thing"})

    with pytest.raises(ConnectorEntryPointError) as caught:
        registry.resolve(transfer("Exiting"))

    assert str(caught.value) == (
        "The entry point 'Exiting = tests.support.plugin_modules.exiting:Thing' (group "
        "'kvwire.connectors') of distribution 'kvwire-sample-plugin 1.2' cannot be loaded: "
        "SystemExit: plugin settings from redis://u:***@h (password=***"
    )
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
