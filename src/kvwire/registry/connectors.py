"""The registry of connectors: one lazy provider per connector name.

Every known connector is a `providers.Singleton` in a dependency-injector
container
(`kvwire.ConnectorRegistry.providers`): calling
it imports the connector's module and returns its class, once; registering
imports nothing. Names come from three places (`PluginSource`), kept by the
mechanism the medium registry shares (`PluginNames`): the connectors kvwire
ships, the `kvwire.connectors` entry-point group of installed distributions
(`Name = package.module:Class`), and
`kvwire.ConnectorRegistry.register_connector`
at run time.

`kvwire.ConnectorRegistry.resolve` turns a `KVTransferConfig` into a
class in vLLM's factory's order and with its messages; unlike vLLM's, it checks the constructor of
every class it hands out, so a plugin with the old 2-argument signature fails here, clearly, rather
than with a TypeError later.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dependency_injector import containers
from dependency_injector.providers import Provider

from kvwire.common.extras import missing_extra
from kvwire.common.plugin_calls import PluginExit, contained_exits, plugin_message
from kvwire.common.redaction import shown, shown_key
from kvwire.config.extra_config import ExtraConfigError
from kvwire.exceptions import (
    ConnectorEntryPointError,
    ConnectorImportError,
    KVWireError,
    NotAConnectorError,
)
from kvwire.exceptions import ModulePathError as ModulePathError
from kvwire.interface.base import (
    ConnectorBuilder,
    KVConnectorBase,
    KVConnectorRole,
    supports_kw,
)
from kvwire.registry.eviction import EVICTION_POLICIES_ENTRY_POINT_GROUP, EvictionPolicyRegistry
from kvwire.registry.media import MEDIA_ENTRY_POINT_GROUP, MediumRegistry
from kvwire.registry.names import (
    PluginNames,
    PluginSource,
    RegisteredPlugin,
    check_target,
    closest_name,
    is_module_path,
    listed_names,
)

if TYPE_CHECKING:
    from kvwire.config import EngineConfig, KVTransferConfig
    from kvwire.config.kv_cache import KVCacheConfig
    from kvwire.media.base import Medium

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvwire.connectors"
MAX_COMPOSITE_DEPTH = 16

BUILT_IN_CONNECTORS: dict[str, tuple[str, str]] = {
    "CPUOffloadConnector": ("kvwire.connectors.offload.presets", "CPUOffloadConnector"),
    "OffloadConnector": ("kvwire.connectors.offload.connector", "OffloadConnector"),
    "SharedStorageConnector": ("kvwire.connectors.offload.presets", "SharedStorageConnector"),
    "MultiConnector": ("kvwire.connectors.multi.connector", "MultiConnector"),
    "RedisConnector": ("kvwire.connectors.offload.presets", "RedisConnector"),
    "TieredOffloadConnector": ("kvwire.connectors.offload.presets", "TieredOffloadConnector"),
}
"""The connectors kvwire ships: name -> (module path, class name)."""


def accepts_connector_builder(connector_cls: type) -> bool:
    """Whether `connector_cls` is a composite: it takes a keyword-only `connector_builder`."""
    return accepts_keyword_only(connector_cls, "connector_builder")


def accepts_medium(connector_cls: type) -> bool:
    """Whether `connector_cls` is an offload connector: it takes a keyword-only `medium`, built."""
    return accepts_keyword_only(connector_cls, "medium")


def accepts_keyword_only(connector_cls: type, name: str) -> bool:
    """Whether `connector_cls`'s constructor declares `name` as a keyword-only parameter."""
    try:
        parameters = inspect.signature(connector_cls).parameters
    except (TypeError, ValueError):
        return False
    parameter = parameters.get(name)
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def check_connector_class(connector_cls: Any, name: str, origin: str) -> type[KVConnectorBase]:
    """`connector_cls` if it is a usable connector class, else the error saying why.

    `origin` says where the name led (`module path kvwire_echo`,
    `entry point ...`) for the message.
    """
    if not (isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase)):
        raise NotAConnectorError(
            f"Connector {name} ({origin}) is {connector_cls!r}, "
            "not a class deriving from kvwire.KVConnectorBase"
        )
    if not supports_kw(connector_cls, "kv_cache_config"):
        message = (
            f"Connector {connector_cls.__name__} uses deprecated "
            "2-argument constructor signature. External v1 KV "
            "connectors must accept kv_cache_config as the third "
            "constructor argument and pass it to super().__init__()."
        )
        logger.error(message)
        raise ValueError(message)
    return connector_cls


class ConnectorRegistry:
    """Connector names mapped to lazy class providers.

    `providers` is the dependency-injector container of those providers, one
    per name (`registry.provider("CPUOffloadConnector").override(...)`
    swaps one entry for a test). Entry points are read from the installed
    distributions' metadata the first time a name is looked up; nothing is
    imported before a name is resolved.
    """

    def __init__(
        self,
        *,
        built_ins: dict[str, tuple[str, str]] | None = None,
        entry_point_group: str | None = ENTRY_POINT_GROUP,
    ) -> None:
        self._names = PluginNames(
            "connector",
            self._load,
            built_ins=BUILT_IN_CONNECTORS if built_ins is None else built_ins,
            entry_point_group=entry_point_group,
        )
        self._lock = threading.RLock()
        self._nesting = threading.local()
        # Classes found through a module path, so that a by-name lookup (e.g.
        # rebuilding a composite child's stats) finds them too.
        self._module_path_classes: dict[str, type[KVConnectorBase]] = {}
        # The media its connectors keep blocks in: overriding one here
        # reaches every connector this registry builds.
        self.media = MediumRegistry(
            entry_point_group=None if entry_point_group is None else MEDIA_ENTRY_POINT_GROUP
        )
        # The eviction policies a CPU pool's `eviction` option names.
        self.eviction_policies = EvictionPolicyRegistry(
            entry_point_group=(
                None if entry_point_group is None else EVICTION_POLICIES_ENTRY_POINT_GROUP
            )
        )

    # ----------------------------------------------------------- registering

    def copy(self) -> ConnectorRegistry:
        """A private registry holding the names this one knows now, for one container or test.

        Every name comes along (built in, entry points, registered at run
        time), each with a fresh lazy provider: overriding an entry of the
        copy, or registering a name in it, reaches only the containers given
        the copy. What it drops: the overrides active on this registry at the
        time, and names registered here afterwards.
        """
        with self._lock:
            copied = ConnectorRegistry(built_ins={}, entry_point_group=None)
            copied._names = self._names.copy(copied._load)
            copied._module_path_classes = dict(self._module_path_classes)
            copied.media = self.media.copy()
            copied.eviction_policies = self.eviction_policies.copy()
        return copied

    def register_connector(self, name: str, module_path: str, class_name: str) -> None:
        """Register `name` lazily: `module_path` is imported only when it is resolved."""
        _check_registration(name, module_path, class_name)
        self._names.register(name, module_path, class_name)

    @property
    def providers(self) -> containers.DynamicContainer:
        """One lazy provider per connector name (override one to swap its class)."""
        return self._names.providers

    # -------------------------------------------------------------- looking up

    def entries(self) -> list[RegisteredPlugin]:
        """Every registered name, built-ins first; imports nothing."""
        return self._names.entries()

    def entry(self, name: str) -> RegisteredPlugin:
        entry = self._names.get(name)
        if entry is None:
            raise ValueError(f"Connector '{name}' is not registered.")
        return entry

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def provider(self, name: str) -> Provider[type[KVConnectorBase]]:
        """The lazy provider of `name`'s class (override it to swap the class)."""
        self.entry(name)
        provider: Provider[type[KVConnectorBase]] = self._names.provider(name)
        return provider

    def get_class(self, name: str) -> type[KVConnectorBase]:
        """The class registered as `name` (imported on first use), checked.

        A class found earlier through a module path is found by its name too,
        when no registered connector has that name.
        """
        if name not in self._names and name in self._module_path_classes:
            return self._module_path_classes[name]
        connector_cls = self.provider(name)()
        return check_connector_class(connector_cls, name, self._describe_origin(name))

    def _describe_origin(self, name: str) -> str:
        entry = self.entry(name)
        if entry.source is PluginSource.ENTRY_POINT:
            return f"entry point '{name} = {entry.target}' of distribution {entry.distribution}"
        return f"{entry.source.value} as {entry.target}"

    def _load(self, entry: RegisteredPlugin) -> Any:
        if entry.source is PluginSource.ENTRY_POINT:
            return self._load_entry_point(entry)
        try:
            with contained_exits():
                module = importlib.import_module(entry.module_path)
        except ImportError as error:
            missing = missing_extra(error, f"Connector '{entry.name}' ({entry.target})")
            if missing is not None:
                raise missing from error
            raise ConnectorImportError(
                f"Connector '{entry.name}' is {entry.source.value} as {entry.target}, "
                f"but its module cannot be imported: {error}"
            ) from error
        # Whatever else its module raises at import (a RuntimeError, a
        # sys.exit()): the plug-in's failure, its message redacted.
        except Exception as error:
            raise ConnectorImportError(
                f"Connector '{entry.name}' is {entry.source.value} as {entry.target}, "
                f"but its module raised at import: {plugin_message(error)}"
            ) from None
        try:
            return getattr(module, entry.class_name)
        except AttributeError as error:
            message = f"Class {entry.class_name} not found in {entry.module_path}"
            raise AttributeError(message) from error

    def _load_entry_point(self, entry: RegisteredPlugin) -> Any:
        where = (
            f"entry point '{entry.name} = {entry.target}' "
            f"(group '{self._names.entry_point_group}') "
            f"of distribution {entry.distribution}"
        )
        if not entry.module_path or not entry.class_name:
            raise ConnectorEntryPointError(
                f"The {where} must name a class as 'package.module:Class'"
            )
        try:
            with contained_exits():
                module = importlib.import_module(entry.module_path)
                return getattr(module, entry.class_name)
        except PluginExit as error:
            raise ConnectorEntryPointError(
                f"The {where} cannot be loaded: {plugin_message(error)}"
            ) from None
        except Exception as error:
            raise ConnectorEntryPointError(
                f"The {where} cannot be loaded: {type(error).__name__}: {error}"
            ) from error

    # ------------------------------------------------------------- resolving

    def resolve(self, kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase]:
        """The connector class `kv_transfer_config` names, in vLLM's order.

        Name unset; empty module path; a module path wins over the registry
        (import errors propagate unchanged); then the registry; else unknown.
        """
        connector_name = kv_transfer_config.kv_connector
        if connector_name is None:
            raise ValueError("Connector name is not set in KVTransferConfig")
        module_path = kv_transfer_config.kv_connector_module_path
        if module_path is not None and not module_path:
            raise ValueError("kv_connector_module_path cannot be an empty string.")
        if module_path:
            module = importlib.import_module(module_path)
            try:
                found = getattr(module, connector_name)
            except AttributeError as error:
                message = f"Class {connector_name} not found in {module_path}"
                raise AttributeError(message) from error
            connector_cls = check_connector_class(
                found, connector_name, f"module path {module_path}"
            )
            self._module_path_classes[connector_name] = connector_cls
            return connector_cls
        if connector_name in self:
            return self.get_class(connector_name)
        raise ValueError(self._unsupported(connector_name))

    def _unsupported(self, connector_name: str) -> str:
        """vLLM's exact sentence for an unknown name, then the names it could have meant."""
        names = self._names.names()
        message = f"Unsupported connector type: {connector_name}"
        closest = closest_name(connector_name, names)
        if closest is not None:
            message += f" (did you mean {closest}?)"
        return (
            f"{message}; known connectors: {listed_names(names) or 'none'} "
            "(kvwire connectors lists them, with their modules)"
        )

    def check_module_path(
        self, kv_transfer_config: KVTransferConfig, where: str = "kv_transfer_config"
    ) -> None:
        """Import `kv_connector_module_path` and find the class there, or say why not by field.

        `kvwire.ConnectorRegistry.resolve` keeps vLLM's behaviour (an import error
        propagates unchanged, `Class X not found in M`); a profile's reader (`kvwire check`,
        `kvwire run`, the engine) calls this first, so that a bad module path is a
        `kvwire.exceptions.ModulePathError` naming `where`'s
        `kv_connector_module_path`, with the module's message redacted, whatever the module raised
        at import (a `sys.exit()` included). The children a composite lists vLLM's way (`connectors`
        in its extra config) are checked too, each named by its own path. Nothing happens for a
        field unset or empty (`kvwire.ConnectorRegistry.resolve` refuses an empty one in
        vLLM's words).
        """
        self._check_module_path(
            kv_transfer_config.kv_connector_module_path, kv_transfer_config.kv_connector, where
        )
        self._check_children_module_paths(kv_transfer_config.kv_connector_extra_config, where, 1)

    def _check_children_module_paths(self, extra_config: object, where: str, depth: int) -> None:
        children = extra_config.get("connectors") if isinstance(extra_config, Mapping) else None
        if not isinstance(children, list) or depth > MAX_COMPOSITE_DEPTH:
            return  # no children, or nested past what resolving them will refuse
        for index, child in enumerate(children):
            if not isinstance(child, Mapping):
                continue  # the composite's own checks say what is wrong with it
            child_where = f"{where}.kv_connector_extra_config.connectors[{index}]"
            module_path = child.get("kv_connector_module_path")
            if isinstance(module_path, str):
                self._check_module_path(module_path, child.get("kv_connector"), child_where)
            self._check_children_module_paths(
                child.get("kv_connector_extra_config"), child_where, depth + 1
            )

    @staticmethod
    def _check_module_path(module_path: str | None, class_name: object, where: str) -> None:
        if not module_path:
            return
        field = f"{where}.kv_connector_module_path"
        name_field = f"{where}.kv_connector"
        if not is_module_path(module_path):
            # importlib would echo it raw, or read a leading dot as a relative import.
            raise ModulePathError(
                f"{field}: {shown(module_path)} is not a module path; expected an absolute "
                "dotted module name such as 'package.module'"
            )
        try:
            with contained_exits():
                module = importlib.import_module(module_path)
                # A name that is no string is the composite's own checks' to report.
                found = not isinstance(class_name, str) or hasattr(module, class_name)
        except Exception as error:
            raise ModulePathError(
                f"{field}: cannot import {shown(module_path)}: {plugin_message(error)}; "
                f"expected an importable module defining the class {name_field} names"
            ) from None
        if not found:
            raise ModulePathError(
                f"{field}: Class {shown_key(class_name)} not found in {shown_key(module_path)}; "
                f"expected a module defining the class {name_field} names"
            )

    def supports_hma_config(self, kv_transfer_config: KVTransferConfig) -> bool:
        """Whether the connector `kv_transfer_config` names supports HMA as configured.

        The class answers through its `supports_hma_for_config` hook, so a
        composite (and any subclass of one) asks about each child through
        this same registry.
        """
        return self.class_supports_hma(self.resolve(kv_transfer_config), kv_transfer_config)

    def class_supports_hma(
        self, connector_cls: type[KVConnectorBase], kv_transfer_config: KVTransferConfig
    ) -> bool:
        """Whether `connector_cls` (resolved already, perhaps an override) supports HMA here.

        A composite's children are resolved through this registry.
        """

        def child_supports_hma(child: KVTransferConfig) -> bool:
            return self.class_supports_hma(self.resolve(child), child)

        with self._nested(connector_cls):
            try:
                with contained_exits():
                    return connector_cls.supports_hma_for_config(
                        kv_transfer_config, child_supports_hma
                    )
            # Refusals in kvwire's and vLLM's words (a child that cannot be
            # resolved, a composite nested too deep) pass as they are.
            except (ValueError, ImportError, KVWireError) as error:
                if not isinstance(error, PluginExit):
                    raise
                failure: BaseException = error
            # Anything else is the plug-in's hook failing: its error, redacted,
            # never a traceback quoting its message raw.
            except Exception as error:
                failure = error
        raise ExtraConfigError(
            f"kv_transfer_config.kv_connector: {connector_cls.__name__}.supports_hma_for_config "
            f"raised {plugin_message(failure)}"
        ) from None

    # -------------------------------------------------------------- building

    def instantiate(
        self,
        connector_cls: type[KVConnectorBase],
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        medium: Medium | None = None,
        connector_builder: ConnectorBuilder | None = None,
    ) -> KVConnectorBase:
        """Call `connector_cls` as vLLM does, handing it what it declares it takes, built.

        Nothing is resolved here: an offload connector (keyword-only `medium`)
        gets `medium`, a composite (keyword-only `connector_builder`) gets
        `connector_builder`; a
        `kvwire.KVConnectorContainer` builds both.
        """
        engine_id = config.kv_transfer_config.engine_id if config.kv_transfer_config else None
        logger.info(
            "Creating v1 connector with name: %s and engine_id: %s",
            connector_cls.__name__,
            engine_id,
        )
        try:
            with contained_exits():
                return self._construct(
                    connector_cls, config, role, kv_cache_config, medium, connector_builder
                )
        except PluginExit as error:
            # A constructor that calls sys.exit(): the connector's failure, not the engine's exit.
            raise ExtraConfigError(
                f"kv_transfer_config.kv_connector: {connector_cls.__name__}() raised "
                f"{plugin_message(error)}"
            ) from None

    def _construct(
        self,
        connector_cls: type[KVConnectorBase],
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        medium: Medium | None,
        connector_builder: ConnectorBuilder | None,
    ) -> KVConnectorBase:
        if accepts_connector_builder(connector_cls):
            with self._nested(connector_cls):
                return connector_cls(  # type: ignore[call-arg]
                    config, role, kv_cache_config, connector_builder=connector_builder
                )
        if accepts_medium(connector_cls):
            return connector_cls(  # type: ignore[call-arg]
                config, role, kv_cache_config, medium=medium
            )
        return connector_cls(config, role, kv_cache_config)

    @contextlib.contextmanager
    def _nested(self, connector_cls: type[KVConnectorBase]) -> Iterator[None]:
        # A composite whose children name the composite again would recurse
        # until Python's stack runs out; stop early and say why.
        depth = getattr(self._nesting, "depth", 0)
        if depth >= MAX_COMPOSITE_DEPTH:
            raise ValueError(
                f"Connector {connector_cls.__name__}: composite connectors nest more than "
                f"{MAX_COMPOSITE_DEPTH} levels deep; does a child in "
                "kv_connector_extra_config name its own parent?"
            )
        self._nesting.depth = depth + 1
        try:
            yield
        finally:
            self._nesting.depth = depth


def _check_registration(name: object, module_path: object, class_name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_connector: name must be a non-empty string, got {shown(name)}")
    check_target("register_connector", module_path, class_name)


_default_registry: ConnectorRegistry | None = None
_default_registry_lock = threading.Lock()


def default_registry() -> ConnectorRegistry:
    """The process-wide registry that `KVConnectorFactory` and new containers share."""
    global _default_registry
    with _default_registry_lock:
        if _default_registry is None:
            _default_registry = ConnectorRegistry()
        return _default_registry
