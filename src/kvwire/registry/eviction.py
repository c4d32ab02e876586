"""The registry of eviction policies: one lazy provider per policy name, as media have.

An eviction policy ([`EvictionPolicy`][kvwire.media.eviction.EvictionPolicy])
decides which entry a full CPU pool gives up; the pool's `eviction` option
names it. Names come from the same three places as media's: the policies
kvwire ships (`lru`, `s3fifo`, `arc`), the `kvwire.eviction_policies` entry-point
group of installed distributions (`name = package.module:Class`) and
`EvictionPolicyRegistry.register_policy` at run time; a `package.module:Class`
names a class directly. Every [`ConnectorRegistry`][kvwire.ConnectorRegistry]
holds one (`registry.eviction_policies`); the container resolves a pool's
option through its own registry's and hands the pool the class.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from dependency_injector import containers
from dependency_injector.providers import Provider

from kvwire.exceptions import UnknownEvictionPolicyError as UnknownEvictionPolicyError
from kvwire.plugin_calls import PluginExit, contained_exits, plugin_message
from kvwire.redaction import redact_text, shown
from kvwire.registry.names import (
    PluginNames,
    RegisteredPlugin,
    closest_name,
    is_module_path,
    listed_names,
)

if TYPE_CHECKING:
    from kvwire.media.eviction import EvictionPolicy

EVICTION_POLICIES_ENTRY_POINT_GROUP = "kvwire.eviction_policies"

BUILT_IN_EVICTION_POLICIES: dict[str, tuple[str, str]] = {
    "lru": ("kvwire.media.eviction", "LRUPolicy"),
    "s3fifo": ("kvwire.media.eviction", "S3FIFOPolicy"),
    "arc": ("kvwire.media.eviction", "ARCPolicy"),
}
"""The eviction policies kvwire ships: name -> (module path, class name)."""


class EvictionPolicyRegistry:
    """Eviction policy names mapped to lazy class providers (`providers`, one per name)."""

    def __init__(
        self,
        *,
        built_ins: dict[str, tuple[str, str]] | None = None,
        entry_point_group: str | None = EVICTION_POLICIES_ENTRY_POINT_GROUP,
    ) -> None:
        self._names = PluginNames(
            "eviction policy",
            self._load,
            built_ins=BUILT_IN_EVICTION_POLICIES if built_ins is None else built_ins,
            entry_point_group=entry_point_group,
        )

    @property
    def providers(self) -> containers.DynamicContainer:
        """One lazy provider per policy name (override one to swap its class)."""
        return self._names.providers

    def copy(self) -> EvictionPolicyRegistry:
        """A registry with the names this one knows, each with a fresh provider (no overrides)."""
        copied = EvictionPolicyRegistry(built_ins={}, entry_point_group=None)
        copied._names = self._names.copy(copied._load)
        return copied

    def register_policy(self, name: str, module_path: str, class_name: str) -> None:
        """Register `name` lazily: `module_path` is imported only once a pool needs it."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"register_policy: name must be an identifier, got {shown(name)}")
        if not isinstance(module_path, str) or not is_module_path(module_path):
            raise ValueError(
                "register_policy: module_path must be a dotted module name such as "
                f"'package.module', got {shown(module_path)}"
            )
        if not isinstance(class_name, str) or not class_name.isidentifier():
            raise ValueError(
                f"register_policy: class_name must be a Python identifier, got {shown(class_name)}"
            )
        self._names.register(name, module_path, class_name)

    def names(self) -> list[str]:
        """Every registered policy name, built-ins first; imports nothing."""
        return self._names.names()

    def entries(self) -> list[RegisteredPlugin]:
        """Every registered policy, built-ins first; imports nothing."""
        return self._names.entries()

    def provider(self, name: str) -> Provider[type[EvictionPolicy]]:
        """The lazy provider of `name`'s class; override it to swap the policy."""
        if name not in self._names:
            raise UnknownEvictionPolicyError(self._unknown(name))
        provider: Provider[type[EvictionPolicy]] = self._names.provider(name)
        return provider

    def get_class(self, spec: str) -> type[EvictionPolicy]:
        """The policy class `spec` names: a registered name, or `package.module:Class`."""
        if not isinstance(spec, str) or not spec:
            raise UnknownEvictionPolicyError(self._unknown(spec))
        if ":" in spec:
            module_path, _, class_name = spec.partition(":")
            if not (is_module_path(module_path) and class_name.isidentifier()):
                raise UnknownEvictionPolicyError(
                    f"eviction policy {shown(spec)} is no registered name and not of the form "
                    "'package.module:Class'; registered: "
                    f"{listed_names(self.names())}"
                )
            return self._check(self._import(module_path, class_name, spec), spec)
        return self._check(self.provider(spec)(), spec)

    def _load(self, entry: RegisteredPlugin) -> Any:
        return self._import(entry.module_path, entry.class_name, f"{entry.name} ({entry.origin})")

    @staticmethod
    def _import(module_path: str, class_name: str, what: str) -> Any:
        try:
            with contained_exits():
                module = importlib.import_module(module_path)
                return getattr(module, class_name)
        # Whatever a module raises at import: the option names it, so it is the option's error.
        except PluginExit as error:
            raise UnknownEvictionPolicyError(
                f"eviction policy {shown(what)} cannot be loaded: {plugin_message(error, 200)}"
            ) from None
        except Exception as error:
            raise UnknownEvictionPolicyError(
                f"eviction policy {shown(what)} cannot be loaded: {type(error).__name__}: "
                f"{redact_text(str(error))[:200]}"
            ) from error

    def _check(self, found: Any, spec: str) -> type[EvictionPolicy]:
        from kvwire.media.eviction import EvictionPolicy

        if not (isinstance(found, type) and issubclass(found, EvictionPolicy)):
            raise UnknownEvictionPolicyError(
                f"eviction policy {shown(spec)} is {shown(found)}, not a class deriving from "
                "kvwire.media.eviction.EvictionPolicy"
            )
        if inspect.isabstract(found):
            missing = ", ".join(sorted(found.__abstractmethods__))
            raise UnknownEvictionPolicyError(
                f"eviction policy {shown(spec)} is abstract (it does not implement {missing})"
            )
        return found

    def _unknown(self, name: object) -> str:
        names = self.names()
        message = (
            f"unknown eviction policy {shown(name)}; expected one of {listed_names(names)}, "
            "or a class as 'package.module:Class'"
        )
        closest = closest_name(name, names)
        if closest is not None:
            message += f"; did you mean {closest!r}?"
        return message
