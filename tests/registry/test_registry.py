"""The registry: lazy class providers by name, and resolution in vLLM's order."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
from dependency_injector import providers

from kvwire.config import KVTransferConfig
from kvwire.exceptions import ConnectorImportError, NotAConnectorError
from kvwire.registry import (
    BUILT_IN_CONNECTORS,
    ConnectorRegistry,
    ModulePathError,
    PluginSource,
    UnknownMediumError,
    accepts_connector_builder,
    default_registry,
)
from tests.support.connectors import (
    CompositeConnector,
    CompositeSubclass,
    HMAConnector,
    RecordingConnector,
    TwoArgumentConnector,
    VarKeywordConnector,
)

DEPRECATED = (
    "Connector {} uses deprecated 2-argument constructor signature. External v1 KV "
    "connectors must accept kv_cache_config as the third constructor argument and pass it "
    "to super().__init__()."
)


def transfer(name: str | None, **fields: object) -> KVTransferConfig:
    role = "kv_both" if name is not None else None
    return KVTransferConfig(kv_connector=name, kv_role=role, **fields)  # type: ignore[arg-type]


def test_registering_imports_nothing(plugin_module: str) -> None:
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)

    registry.register_connector("Plugin", plugin_module, "PluginConnector")

    assert plugin_module not in sys.modules
    assert registry.entry("Plugin").target == f"{plugin_module}:PluginConnector"


def test_resolving_a_name_imports_its_module(plugin_module: str) -> None:
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    registry.register_connector("Plugin", plugin_module, "PluginConnector")

    connector_cls = registry.resolve(transfer("Plugin"))

    assert plugin_module in sys.modules
    assert connector_cls is sys.modules[plugin_module].PluginConnector


def test_a_resolved_class_is_cached_and_never_imported_again(plugin_module: str) -> None:
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    registry.register_connector("Plugin", plugin_module, "PluginConnector")
    first = registry.get_class("Plugin")
    del sys.modules[plugin_module]

    assert registry.get_class("Plugin") is first
    assert plugin_module not in sys.modules


def test_resolving_one_name_imports_no_other(
    plugin_module: str, registry: ConnectorRegistry
) -> None:
    registry.register_connector("Plugin", plugin_module, "PluginConnector")

    registry.resolve(transfer("RecordingConnector"))

    assert plugin_module not in sys.modules


def test_a_new_registry_knows_the_built_ins_without_importing_them() -> None:
    registry = ConnectorRegistry(entry_point_group=None)

    assert [entry.name for entry in registry.entries()] == list(BUILT_IN_CONNECTORS)
    assert {entry.source for entry in registry.entries()} == {PluginSource.BUILT_IN}
    assert registry.entry("CPUOffloadConnector").target == (
        "kvwire.connectors.offload.presets:CPUOffloadConnector"
    )


def test_registering_a_taken_name_is_an_error(registry: ConnectorRegistry) -> None:
    with pytest.raises(ValueError) as caught:
        registry.register_connector("RecordingConnector", "anywhere", "Anything")

    assert str(caught.value) == "Connector 'RecordingConnector' is already registered."


def test_registering_a_built_in_name_is_an_error() -> None:
    registry = ConnectorRegistry(entry_point_group=None)

    with pytest.raises(ValueError, match=r"^Connector 'MultiConnector' is already registered\.$"):
        registry.register_connector("MultiConnector", "anywhere", "Anything")


def test_looking_up_an_unknown_name_is_an_error(registry: ConnectorRegistry) -> None:
    with pytest.raises(ValueError) as caught:
        registry.get_class("Nope")

    assert str(caught.value) == "Connector 'Nope' is not registered."


def test_a_config_without_a_name_is_an_error(registry: ConnectorRegistry) -> None:
    with pytest.raises(ValueError) as caught:
        registry.resolve(transfer(None))

    assert str(caught.value) == "Connector name is not set in KVTransferConfig"


def test_an_empty_module_path_is_an_error(registry: ConnectorRegistry) -> None:
    with pytest.raises(ValueError) as caught:
        registry.resolve(transfer("RecordingConnector", kv_connector_module_path=""))

    assert str(caught.value) == "kv_connector_module_path cannot be an empty string."


def test_a_module_path_wins_over_the_registry(
    registry: ConnectorRegistry, plugin_module: str
) -> None:
    registry.register_connector("PluginConnector", "tests.support.connectors", "HMAConnector")

    resolved = registry.resolve(transfer("PluginConnector", kv_connector_module_path=plugin_module))

    assert resolved is sys.modules[plugin_module].PluginConnector


def test_a_module_path_that_cannot_be_imported_raises_the_import_error_unchanged(
    registry: ConnectorRegistry,
) -> None:
    with pytest.raises(ModuleNotFoundError, match="No module named 'no_such_module_here'"):
        registry.resolve(transfer("X", kv_connector_module_path="no_such_module_here"))


def test_a_class_missing_from_its_module_path_is_an_attribute_error_chained(
    registry: ConnectorRegistry,
) -> None:
    with pytest.raises(AttributeError) as caught:
        registry.resolve(transfer("Missing", kv_connector_module_path="tests.support.connectors"))

    assert str(caught.value) == "Class Missing not found in tests.support.connectors"
    assert isinstance(caught.value.__cause__, AttributeError)


def test_a_two_argument_constructor_by_module_path_is_logged_then_refused(
    registry: ConnectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    config = transfer("TwoArgumentConnector", kv_connector_module_path="tests.support.connectors")

    with (
        caplog.at_level(logging.ERROR, logger="kvwire.registry"),
        pytest.raises(ValueError) as caught,
    ):
        registry.resolve(config)

    assert str(caught.value) == DEPRECATED.format("TwoArgumentConnector")
    assert [record.getMessage() for record in caplog.records] == [str(caught.value)]


def test_a_two_argument_constructor_registered_at_run_time_is_refused_too(
    registry: ConnectorRegistry,
) -> None:
    with pytest.raises(ValueError) as caught:
        registry.resolve(transfer("TwoArgumentConnector"))

    assert str(caught.value) == DEPRECATED.format("TwoArgumentConnector")


def test_a_constructor_taking_kwargs_passes_the_signature_check(
    registry: ConnectorRegistry,
) -> None:
    assert registry.resolve(transfer("VarKeywordConnector")) is VarKeywordConnector


def test_an_unknown_name_is_unsupported(registry: ConnectorRegistry) -> None:
    with pytest.raises(ValueError) as caught:
        registry.resolve(transfer("Nope"))

    # vLLM's sentence first, then what kvwire knows.
    assert str(caught.value) == (
        "Unsupported connector type: Nope; known connectors: RecordingConnector, HMAConnector, "
        "CompositeConnector, CompositeSubclass, VarKeywordConnector, TwoArgumentConnector "
        "(kvwire connectors lists them, with their modules)"
    )


def test_a_name_that_is_not_a_connector_class_is_refused(registry: ConnectorRegistry) -> None:
    with pytest.raises(NotAConnectorError) as caught:
        registry.resolve(
            transfer("NOT_A_CLASS", kv_connector_module_path="tests.support.connectors")
        )

    assert str(caught.value) == (
        "Connector NOT_A_CLASS (module path tests.support.connectors) is 42, "
        "not a class deriving from kvwire.KVConnectorBase"
    )


def test_a_registered_module_that_cannot_be_imported_names_the_connector() -> None:
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    registry.register_connector("Ghost", "no_such_module_here", "Ghost")

    with pytest.raises(ConnectorImportError) as caught:
        registry.resolve(transfer("Ghost"))

    assert str(caught.value) == (
        "Connector 'Ghost' is registered at run time as no_such_module_here:Ghost, "
        "but its module cannot be imported: No module named 'no_such_module_here'"
    )
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_a_registered_class_missing_from_its_module_is_an_attribute_error() -> None:
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    registry.register_connector("Gone", "tests.support.connectors", "Gone")

    with pytest.raises(AttributeError) as caught:
        registry.resolve(transfer("Gone"))

    assert str(caught.value) == "Class Gone not found in tests.support.connectors"


def test_overriding_one_entry_swaps_its_class_until_the_block_ends(
    registry: ConnectorRegistry,
) -> None:
    with registry.provider("RecordingConnector").override(providers.Object(HMAConnector)):
        assert registry.resolve(transfer("RecordingConnector")) is HMAConnector
        assert registry.resolve(transfer("HMAConnector")) is HMAConnector

    assert registry.resolve(transfer("RecordingConnector")) is RecordingConnector


def test_an_overriding_class_is_signature_checked_too(registry: ConnectorRegistry) -> None:
    old = TwoArgumentConnector

    with (
        registry.provider("RecordingConnector").override(providers.Object(old)),
        pytest.raises(ValueError, match="uses deprecated 2-argument constructor signature"),
    ):
        registry.resolve(transfer("RecordingConnector"))


def test_a_class_found_by_module_path_is_found_by_name_afterwards(
    registry: ConnectorRegistry, plugin_module: str
) -> None:
    found = registry.resolve(transfer("PluginConnector", kv_connector_module_path=plugin_module))

    assert registry.get_class("PluginConnector") is found


# ------------------------------------------------------- private copies


def test_a_copy_knows_every_name_including_those_registered_at_run_time(
    registry: ConnectorRegistry,
) -> None:
    copied = registry.copy()

    assert [entry.name for entry in copied.entries()] == [
        entry.name for entry in registry.entries()
    ]
    assert copied.resolve(transfer("HMAConnector")) is HMAConnector


def test_overriding_an_entry_of_a_copy_leaves_the_original_alone(
    registry: ConnectorRegistry,
) -> None:
    copied = registry.copy()

    with copied.provider("RecordingConnector").override(providers.Object(HMAConnector)):
        assert copied.resolve(transfer("RecordingConnector")) is HMAConnector
        assert registry.resolve(transfer("RecordingConnector")) is RecordingConnector


def test_a_copy_drops_the_overrides_active_on_the_original(registry: ConnectorRegistry) -> None:
    with registry.provider("RecordingConnector").override(providers.Object(HMAConnector)):
        copied = registry.copy()

    assert copied.resolve(transfer("RecordingConnector")) is RecordingConnector


def test_a_name_registered_in_a_copy_stays_in_the_copy(registry: ConnectorRegistry) -> None:
    copied = registry.copy()

    copied.register_connector("Private", "tests.support.connectors", "HMAConnector")

    assert "Private" in copied
    assert "Private" not in registry


def test_the_copy_of_the_default_registry_keeps_the_built_ins() -> None:
    copied = default_registry().copy()

    assert {"CPUOffloadConnector", "MultiConnector"} <= {entry.name for entry in copied.entries()}


def test_a_composite_is_recognised_by_its_keyword_only_connector_builder() -> None:
    assert accepts_connector_builder(CompositeConnector)
    assert accepts_connector_builder(CompositeSubclass)
    assert not accepts_connector_builder(RecordingConnector)


def test_a_composite_that_contains_itself_is_stopped_with_a_clear_error(
    registry: ConnectorRegistry,
) -> None:
    looping = KVTransferConfig(
        kv_connector="CompositeConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [{"kv_connector": "CompositeSubclass"}]},
    )
    with (
        registry.provider("CompositeSubclass").override(providers.Object(_SelfNesting)),
        pytest.raises(ValueError) as caught,
    ):
        registry.supports_hma_config(looping)

    assert str(caught.value) == (
        "Connector _SelfNesting: composite connectors nest more than 16 levels deep; does a "
        "child in kv_connector_extra_config name its own parent?"
    )


class _SelfNesting(CompositeConnector):
    """A composite whose HMA answer asks about a config naming itself again."""

    @classmethod
    def supports_hma_for_config(
        cls, kv_transfer_config: KVTransferConfig, resolve_child: Any
    ) -> bool:
        return bool(resolve_child(kv_transfer_config))


@pytest.mark.parametrize(
    ("name", "module_path", "class_name", "message"),
    [
        ("", "pkg.mod", "Cls", "register_connector: name must be a non-empty string, got ''"),
        (
            "X",
            "pkg/mod.py",
            "Cls",
            "register_connector: module_path must be a dotted module name such as "
            "'package.module', got 'pkg/mod.py'",
        ),
        # A URL pasted as the module path is shown with its password blanked.
        (
            "X",
            "redis://user:hunter2@host/0",
            "Cls",
            "register_connector: module_path must be a dotted module name such as "
            "'package.module', got 'redis://user:***@host/0'",
        ),
        (
            "X",
            "pkg.mod",
            "pkg.mod:Cls",
            "register_connector: class_name must be a Python identifier, got 'pkg.mod:Cls'",
        ),
    ],
)
def test_a_malformed_registration_is_refused_before_anything_is_stored(
    registry: ConnectorRegistry, name: str, module_path: str, class_name: str, message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        registry.register_connector(name, module_path, class_name)

    assert str(caught.value) == message
    assert "X" not in registry


@pytest.mark.parametrize(
    "module", ["tests.support.plugin_modules.exiting", "tests.support.plugin_modules.raising_hook"]
)
def test_a_registered_module_that_raises_at_import_names_the_connector_redacted(
    module: str,
) -> None:
    # sys.exit() and a RuntimeError at import alike: the plug-in's failure, not kvwire's exit.
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    registry.register_connector("Broken", module, "Broken")

    with pytest.raises(ConnectorImportError) as caught:
        registry.resolve(transfer("Broken"))

    message = str(caught.value)
    assert message.startswith(
        f"Connector 'Broken' is registered at run time as {module}:Broken, but its module "
        "raised at import: "
    )
    assert "redis://u:***@h" in message and "hunter2" not in message
    assert caught.value.__cause__ is None


def test_a_medium_module_that_calls_sys_exit_is_the_mediums_error_redacted() -> None:
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)

    with pytest.raises(UnknownMediumError) as caught:
        registry.media.get_class("tests.support.plugin_modules.exiting:Medium")

    assert str(caught.value) == (
        "medium 'tests.support.plugin_modules.exiting:Medium' cannot be loaded: SystemExit: plugin "
        "settings from redis://u:***@h (password=***"
    )


def test_check_module_path_leaves_an_unset_path_and_a_good_one_alone(
    registry: ConnectorRegistry,
) -> None:
    registry.check_module_path(transfer("RecordingConnector"))
    registry.check_module_path(
        transfer("RecordingConnector", kv_connector_module_path="tests.support.connectors")
    )


def test_resolve_keeps_vllms_error_for_a_class_missing_from_its_module_path(
    registry: ConnectorRegistry,
) -> None:
    # check_module_path names the field; resolve itself stays as vLLM's factory is.
    config = transfer("Missing", kv_connector_module_path="os")
    with pytest.raises(ModulePathError, match=r"^kv_transfer_config\.kv_connector_module_path: "):
        registry.check_module_path(config)
    with pytest.raises(AttributeError, match=r"^Class Missing not found in os$"):
        registry.resolve(config)
