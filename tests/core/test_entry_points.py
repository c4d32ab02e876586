"""Third-party connectors found through the ``kvwire.connectors`` entry-point group.

Each test puts a distribution's metadata (a ``.dist-info`` folder) on
``sys.path`` in a temporary folder, as ``pip install`` would, without
touching the shared virtual environment.
"""

from __future__ import annotations

import logging
import pathlib
import sys

import pytest

from kvwire.config import KVTransferConfig
from kvwire.exceptions import ConnectorEntryPointError
from kvwire.registry import ConnectorRegistry, ConnectorSource


def install_distribution(
    site: pathlib.Path, monkeypatch: pytest.MonkeyPatch, entry_points: dict[str, str]
) -> None:
    dist_info = site / "kvwire_sample_plugin-1.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvwire-sample-plugin\nVersion: 1.2\n"
    )
    lines = [f"{name} = {value}" for name, value in entry_points.items()]
    (dist_info / "entry_points.txt").write_text("[kvwire.connectors]\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(site))


@pytest.fixture
def site(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "site"
    folder.mkdir()
    return folder


def transfer(name: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role="kv_both")


def test_an_entry_point_is_listed_without_importing_its_module(
    site: pathlib.Path, monkeypatch: pytest.MonkeyPatch, plugin_module: str
) -> None:
    install_distribution(site, monkeypatch, {"Sample": f"{plugin_module}:PluginConnector"})
    registry = ConnectorRegistry(built_ins={})

    (entry,) = registry.entries()

    assert entry.name == "Sample"
    assert entry.source is ConnectorSource.ENTRY_POINT
    assert entry.distribution == "'kvwire-sample-plugin 1.2'"
    assert plugin_module not in sys.modules


def test_an_entry_point_resolves_to_its_class_on_first_use(
    site: pathlib.Path, monkeypatch: pytest.MonkeyPatch, plugin_module: str
) -> None:
    install_distribution(site, monkeypatch, {"Sample": f"{plugin_module}:PluginHMAConnector"})
    registry = ConnectorRegistry(built_ins={})

    connector_cls = registry.resolve(transfer("Sample"))

    assert connector_cls is sys.modules[plugin_module].PluginHMAConnector
    assert registry.supports_hma_config(transfer("Sample"))


def test_a_broken_entry_point_names_its_distribution_and_itself(
    site: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_distribution(site, monkeypatch, {"Broken": "kvwire_missing_plugin_module:Thing"})
    registry = ConnectorRegistry(built_ins={})

    with pytest.raises(ConnectorEntryPointError) as caught:
        registry.resolve(transfer("Broken"))

    assert str(caught.value) == (
        "The entry point 'Broken = kvwire_missing_plugin_module:Thing' (group "
        "'kvwire.connectors') of distribution 'kvwire-sample-plugin 1.2' cannot be loaded: "
        "ModuleNotFoundError: No module named 'kvwire_missing_plugin_module'"
    )
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_an_entry_point_naming_a_missing_class_names_its_distribution(
    site: pathlib.Path, monkeypatch: pytest.MonkeyPatch, plugin_module: str
) -> None:
    install_distribution(site, monkeypatch, {"Typo": f"{plugin_module}:PluginConector"})
    registry = ConnectorRegistry(built_ins={})

    with pytest.raises(ConnectorEntryPointError) as caught:
        registry.resolve(transfer("Typo"))

    assert str(caught.value) == (
        f"The entry point 'Typo = {plugin_module}:PluginConector' (group 'kvwire.connectors') "
        "of distribution 'kvwire-sample-plugin 1.2' cannot be loaded: AttributeError: module "
        f"'{plugin_module}' has no attribute 'PluginConector'"
    )


def test_an_entry_point_without_a_class_is_malformed(
    site: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_distribution(site, monkeypatch, {"Bare": "some_module"})
    registry = ConnectorRegistry(built_ins={})

    with pytest.raises(ConnectorEntryPointError) as caught:
        registry.resolve(transfer("Bare"))

    assert str(caught.value) == (
        "The entry point 'Bare = some_module:' (group 'kvwire.connectors') of distribution "
        "'kvwire-sample-plugin 1.2' must name a class as 'package.module:Class'"
    )


def test_a_plugin_with_a_two_argument_constructor_fails_at_resolution(
    site: pathlib.Path, monkeypatch: pytest.MonkeyPatch, plugin_module: str
) -> None:
    install_distribution(site, monkeypatch, {"Old": f"{plugin_module}:OldPluginConnector"})
    registry = ConnectorRegistry(built_ins={})

    with pytest.raises(ValueError, match=r"^Connector OldPluginConnector uses deprecated"):
        registry.resolve(transfer("Old"))


def test_an_entry_point_cannot_shadow_a_built_in(
    site: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    plugin_module: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    install_distribution(site, monkeypatch, {"Shadow": f"{plugin_module}:PluginConnector"})
    registry = ConnectorRegistry(
        built_ins={"Shadow": ("tests.core.sample_connectors", "HMAConnector")}
    )

    with caplog.at_level(logging.WARNING, logger="kvwire.registry"):
        entry = registry.entry("Shadow")

    assert entry.source is ConnectorSource.BUILT_IN
    assert caplog.records[0].getMessage() == (
        f"Ignoring entry point 'Shadow = {plugin_module}:PluginConnector' of distribution "
        "'kvwire-sample-plugin 1.2': connector 'Shadow' is already registered (built in, "
        "tests.core.sample_connectors:HMAConnector)"
    )


def test_registering_a_name_an_entry_point_declared_is_an_error(
    site: pathlib.Path, monkeypatch: pytest.MonkeyPatch, plugin_module: str
) -> None:
    install_distribution(site, monkeypatch, {"Sample": f"{plugin_module}:PluginConnector"})
    registry = ConnectorRegistry(built_ins={})

    with pytest.raises(ValueError, match=r"^Connector 'Sample' is already registered\.$"):
        registry.register_connector("Sample", "anywhere", "Anything")
