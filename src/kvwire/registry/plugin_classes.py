"""A registry of one kind of plug-in class: what the medium and eviction policy registries are.

Each names classes deriving from one base class
(`kvwire.media.Medium`, `EvictionPolicy`) from the same three places
(`PluginNames`), and also takes a class named directly as
`package.module:Class`. A subclass says which kind (`PluginClassRegistry`'s
class attributes) and registers under its own method name; what it names is
imported only when looked up, its base class only when a class is checked, so
that `import kvwire` imports no medium.
"""

from __future__ import annotations

import abc
import importlib
import inspect
from types import EllipsisType
from typing import Any, ClassVar, Generic, TypeVar

from dependency_injector import containers
from dependency_injector.providers import Provider

from kvwire.common.plugin_calls import PluginExit, contained_exits, plugin_message
from kvwire.common.redaction import redact_text, shown
from kvwire.exceptions import KVWireError
from kvwire.registry.names import (
    PluginNames,
    RegisteredPlugin,
    check_target,
    closest_name,
    is_module_path,
    listed_names,
)

PluginClass = TypeVar("PluginClass", bound=abc.ABC)
"""The base class every class of the registry derives from, abstract."""

Registry = TypeVar("Registry", bound="PluginClassRegistry[Any]")


class PluginClassRegistry(Generic[PluginClass]):
    """Names of one kind of plug-in class, each mapped to a lazy class provider (`providers`).

    A refusal is the kind's `error`, in words naming the kind.
    """

    kind: ClassVar[str]
    """The kind in words, as messages name it: `medium`, `eviction policy`."""
    base: ClassVar[str]
    """The class each one derives from, as `package.module:Class`, imported to check a class."""
    error: ClassVar[type[KVWireError]]
    """What every lookup raises for a name or class it refuses (a ValueError too)."""
    shipped: ClassVar[dict[str, tuple[str, str]]]
    """The names kvwire ships: name -> (module path, class name)."""
    entry_point_group: ClassVar[str]
    """The entry-point group installed distributions declare names in."""
    # The words only some kinds' messages add, each starting as it joins the sentence.
    form_detail: ClassVar[str] = ""
    abstract_advice: ClassVar[str] = ""
    listing_hint: ClassVar[str] = ""

    def __init__(
        self,
        *,
        built_ins: dict[str, tuple[str, str]] | None = None,
        entry_point_group: str | EllipsisType | None = ...,
    ) -> None:
        """`built_ins` defaults to what kvwire ships, `entry_point_group` to the kind's group.

        `entry_point_group=None` reads no entry points.
        """
        self._names = PluginNames(
            self.kind,
            self._load,
            built_ins=self.shipped if built_ins is None else built_ins,
            entry_point_group=(
                type(self).entry_point_group if entry_point_group is ... else entry_point_group
            ),
        )

    @property
    def providers(self) -> containers.DynamicContainer:
        """One lazy provider per name (override one to swap its class)."""
        return self._names.providers

    def copy(self: Registry) -> Registry:
        """A registry with the names this one knows, each with a fresh provider (no overrides)."""
        copied = type(self)(built_ins={}, entry_point_group=None)
        copied._names = self._names.copy(copied._load)
        return copied

    def _register(self, method: str, name: str, module_path: str, class_name: str) -> None:
        """Register `name` lazily: `module_path` is imported only once `name` is looked up.

        `method` is the subclass's registering method, which an argument
        error starts with.
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{method}: name must be an identifier, got {shown(name)}")
        check_target(method, module_path, class_name)
        self._names.register(name, module_path, class_name)

    def names(self) -> list[str]:
        """Every registered name, built-ins first; imports nothing."""
        return self._names.names()

    def entries(self) -> list[RegisteredPlugin]:
        """Every registered name with where it comes from, built-ins first; imports nothing."""
        return self._names.entries()

    def provider(self, name: str) -> Provider[type[PluginClass]]:
        """The lazy provider of `name`'s class; override it to swap the class."""
        if name not in self._names:
            raise self.error(self._unknown(name))
        provider: Provider[type[PluginClass]] = self._names.provider(name)
        return provider

    def get_class(self, spec: str) -> type[PluginClass]:
        """The class `spec` names: a registered name, or `package.module:Class`."""
        if not isinstance(spec, str) or not spec:
            raise self.error(self._unknown(spec))
        if ":" in spec:
            module_path, _, class_name = spec.partition(":")
            # Checked before anything is imported: a relative or malformed
            # path would fail inside importlib with a message that echoes it
            # raw (a URL typed here, password and all).
            if not (is_module_path(module_path) and class_name.isidentifier()):
                raise self.error(
                    f"{self.kind} {shown(spec)} is no registered name and not of the form "
                    f"'package.module:Class'{self.form_detail}; registered: "
                    f"{listed_names(self.names())}"
                )
            return self._check(self._import(module_path, class_name, spec), spec)
        return self._check(self.provider(spec)(), spec)

    def _load(self, entry: RegisteredPlugin) -> Any:
        return self._import(entry.module_path, entry.class_name, f"{entry.name} ({entry.origin})")

    def _import(self, module_path: str, class_name: str, what: str) -> Any:
        try:
            with contained_exits():
                module = importlib.import_module(module_path)
                return getattr(module, class_name)
        # Whatever a module raises at import (a RuntimeError, a SyntaxError, a
        # sys.exit()): a profile names it, so it is the profile's error, shown bounded.
        except PluginExit as error:
            raise self.error(
                f"{self.kind} {shown(what)} cannot be loaded: {plugin_message(error, 200)}"
            ) from None
        except Exception as error:
            raise self._import_failure(error, what) from error

    def _import_failure(self, error: Exception, what: str) -> KVWireError:
        """The error to raise for `error`, raised importing the class `what` names."""
        return self.error(
            f"{self.kind} {shown(what)} cannot be loaded: {type(error).__name__}: "
            f"{redact_text(str(error))[:200]}"
        )

    def _check(self, found: Any, spec: str) -> type[PluginClass]:
        module_path, _, class_name = self.base.partition(":")
        base: type[PluginClass] = getattr(importlib.import_module(module_path), class_name)
        if not (isinstance(found, type) and issubclass(found, base)):
            raise self.error(
                f"{self.kind} {shown(spec)} is {shown(found)}, not a class deriving from "
                f"{module_path}.{class_name}"
            )
        if inspect.isabstract(found):
            # Refused here, so that `kvwire check` refuses what the engine cannot build.
            missing = ", ".join(sorted(found.__abstractmethods__))
            raise self.error(
                f"{self.kind} {shown(spec)} is abstract (it does not implement {missing})"
                f"{self.abstract_advice}"
            )
        return found

    def _unknown(self, name: object) -> str:
        names = self.names()
        message = (
            f"unknown {self.kind} {shown(name)}; expected one of {listed_names(names)}, "
            "or a class as 'package.module:Class'"
        )
        closest = closest_name(name, names)
        if closest is not None:
            message += f"; did you mean {closest!r}?"
        return message + self.listing_hint
