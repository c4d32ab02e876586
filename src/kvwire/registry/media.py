"""The registry of media: one lazy provider per medium name, beside the connectors'.

A medium ([`Medium`][kvwire.media.Medium]) is where an offload connector keeps
blocks. Like connectors, media are named through the same mechanism
(`PluginNames`), and a name is imported only when a connector asks for it: the
media kvwire ships, the `kvwire.media` entry-point group of installed
distributions (`name = package.module:Class`) and
`MediumRegistry.register_medium` at run time. A profile may also name a class
directly, as `package.module:Class`.

Every [`ConnectorRegistry`][kvwire.ConnectorRegistry] holds one
(`registry.media`), and a container's connectors resolve their medium
through it: overriding a medium's provider swaps it for every connector
built through that registry, as overriding a connector's provider does:

```python
registry = default_registry().copy()
with registry.media.provider("directory").override(providers.Object(FaultyDirectory)):
    ...  # containers given `registry` build their connectors over FaultyDirectory
```
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from dependency_injector import containers
from dependency_injector.providers import Provider

from kvwire._extras import missing_extra
from kvwire.exceptions import UnknownMediumError as UnknownMediumError
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
    from kvwire.media.base import Medium

MEDIA_ENTRY_POINT_GROUP = "kvwire.media"

BUILT_IN_MEDIA: dict[str, tuple[str, str]] = {
    "cpu_pool": ("kvwire.media.cpu_pool.medium", "CPUPoolMedium"),
    "directory": ("kvwire.media.store.directory.medium", "DirectoryMedium"),
    "peer": ("kvwire.media.peer.medium", "PeerMedium"),
    "redis": ("kvwire.media.store.redis.medium", "RedisMedium"),
}
"""The media kvwire ships: name -> (module path, class name)."""


class MediumRegistry:
    """Medium names mapped to lazy class providers (`providers`, one per name)."""

    def __init__(
        self,
        *,
        built_ins: dict[str, tuple[str, str]] | None = None,
        entry_point_group: str | None = MEDIA_ENTRY_POINT_GROUP,
    ) -> None:
        self._names = PluginNames(
            "medium",
            self._load,
            built_ins=BUILT_IN_MEDIA if built_ins is None else built_ins,
            entry_point_group=entry_point_group,
        )

    @property
    def providers(self) -> containers.DynamicContainer:
        """One lazy provider per medium name (override one to swap its class)."""
        return self._names.providers

    def copy(self) -> MediumRegistry:
        """A registry with the names this one knows, each with a fresh provider (no overrides)."""
        copied = MediumRegistry(built_ins={}, entry_point_group=None)
        copied._names = self._names.copy(copied._load)
        return copied

    def register_medium(self, name: str, module_path: str, class_name: str) -> None:
        """Register `name` lazily: `module_path` is imported only once a connector needs it."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"register_medium: name must be an identifier, got {shown(name)}")
        if not isinstance(module_path, str) or not is_module_path(module_path):
            raise ValueError(
                "register_medium: module_path must be a dotted module name such as "
                f"'package.module', got {shown(module_path)}"
            )
        if not isinstance(class_name, str) or not class_name.isidentifier():
            raise ValueError(
                f"register_medium: class_name must be a Python identifier, got {shown(class_name)}"
            )
        self._names.register(name, module_path, class_name)

    def names(self) -> list[str]:
        """Every registered medium name, built-ins first; imports nothing."""
        return self._names.names()

    def entries(self) -> list[RegisteredPlugin]:
        """Every registered medium, built-ins first; imports nothing."""
        return self._names.entries()

    def provider(self, name: str) -> Provider[type[Medium]]:
        """The lazy provider of `name`'s class; override it to swap the medium."""
        if name not in self._names:
            raise UnknownMediumError(self._unknown(name))
        provider: Provider[type[Medium]] = self._names.provider(name)
        return provider

    def get_class(self, spec: str) -> type[Medium]:
        """The medium class `spec` names: a registered name, or `package.module:Class`."""
        if not isinstance(spec, str) or not spec:
            raise UnknownMediumError(self._unknown(spec))
        if ":" in spec:
            module_path, _, class_name = spec.partition(":")
            # Checked before anything is imported: a relative or malformed
            # path would fail inside importlib with a message that echoes it
            # raw (a URL typed here, password and all).
            if not (is_module_path(module_path) and class_name.isidentifier()):
                raise UnknownMediumError(
                    f"medium {shown(spec)} is no registered name and not of the form "
                    "'package.module:Class' (a dotted module path of identifiers, then one "
                    f"class name); registered: {listed_names(self.names())}"
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
        # Whatever a module raises at import (a RuntimeError, a SyntaxError, a
        # sys.exit()): a profile names it, so it is the profile's error, shown bounded.
        except PluginExit as error:
            raise UnknownMediumError(
                f"medium {shown(what)} cannot be loaded: {plugin_message(error, 200)}"
            ) from None
        except Exception as error:
            missing = missing_extra(error, f"medium {shown(what)}")
            if missing is not None:
                # A ValueError still (a profile names the medium), whose words say the fix.
                raise UnknownMediumError(str(missing)) from error
            raise UnknownMediumError(
                f"medium {shown(what)} cannot be loaded: {type(error).__name__}: "
                f"{redact_text(str(error))[:200]}"
            ) from error

    def _check(self, found: Any, spec: str) -> type[Medium]:
        from kvwire.media.base import Medium

        if not (isinstance(found, type) and issubclass(found, Medium)):
            raise UnknownMediumError(
                f"medium {shown(spec)} is {shown(found)}, not a class deriving from "
                "kvwire.media.base.Medium"
            )
        if inspect.isabstract(found):
            # Refused here, so that `kvwire check` refuses what the engine cannot build.
            missing = ", ".join(sorted(found.__abstractmethods__))
            raise UnknownMediumError(
                f"medium {shown(spec)} is abstract (it does not implement {missing}); "
                "expected a medium class that can be built, such as a subclass implementing them"
            )
        return found

    def _unknown(self, name: object) -> str:
        names = self.names()
        message = (
            f"unknown medium {shown(name)}; expected one of {listed_names(names)}, "
            "or a class as 'package.module:Class'"
        )
        closest = closest_name(name, names)
        if closest is not None:
            message += f"; did you mean {closest!r}?"
        return f"{message} (kvwire connectors lists every medium)"
