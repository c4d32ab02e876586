"""Plug-in names: the one mechanism behind every plug-in registry (connectors, media, policies).

A name stands for a class that lives in a module, known without importing
it. Names come from three places (`PluginSource`): what kvwire ships,
the entry points of installed distributions (read once, the first time a
name is looked up) and registrations at run time. Each name is a
`providers.Singleton` in a dependency-injector container
(`PluginNames.providers`): calling it imports the module and returns
the class, once; overriding it swaps the class for everything built through
this table. What a class must be, and the words of each error, belong to the
registry that owns the table.
"""

from __future__ import annotations

import difflib
import enum
import logging
import threading
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import attrs
from dependency_injector import containers, providers

from kvwire.common.redaction import SHOWN_LENGTH, shown, shown_key

logger = logging.getLogger(__name__)


class PluginSource(enum.Enum):
    """Where a registered name comes from."""

    BUILT_IN = "built in"
    ENTRY_POINT = "entry point"
    RUNTIME = "registered at run time"


@attrs.frozen
class RegisteredPlugin:
    """What a registry knows about a name without importing anything (read-only).

    `distribution` is `'name version'` of the distribution that declares
    an entry point, else None.
    """

    name: str
    module_path: str
    class_name: str
    source: PluginSource
    distribution: str | None = None

    @property
    def target(self) -> str:
        return f"{self.module_path}:{self.class_name}"

    @property
    def origin(self) -> str:
        """Where the name comes from, in words: `built in`, or the entry point's distribution."""
        if self.distribution is None:
            return self.source.value
        return f"{self.source.value} of distribution {self.distribution}"


def is_module_path(text: str) -> bool:
    """Whether `text` is an absolute dotted module path such as `package.module`."""
    return all(part.isidentifier() for part in text.split("."))


def check_target(method: str, module_path: object, class_name: object) -> None:
    """Refuse a registration's `module_path` or `class_name` that names no class to import.

    `method` is the registering method, which the message starts with
    (`register_medium`); the value refused is shown bounded and redacted.
    """
    if not isinstance(module_path, str) or not is_module_path(module_path):
        raise ValueError(
            f"{method}: module_path must be a dotted module name such as "
            f"'package.module', got {shown(module_path)}"
        )
    if not isinstance(class_name, str) or not class_name.isidentifier():
        raise ValueError(
            f"{method}: class_name must be a Python identifier, got {shown(class_name)}"
        )


# How many names an unknown name's error lists; `kvwire connectors` lists them all.
MAX_LISTED_NAMES = 20


def listed_names(names: Sequence[str]) -> str:
    """`names` joined by commas, cut after `MAX_LISTED_NAMES` with how many more there are."""
    shown_names = [shown_key(name) for name in names[:MAX_LISTED_NAMES]]
    if len(names) > MAX_LISTED_NAMES:
        shown_names.append(f"and {len(names) - MAX_LISTED_NAMES} more")
    return ", ".join(shown_names)


def closest_name(name: object, names: Sequence[str]) -> str | None:
    """The registered name `name` was most likely meant as (a typo's), or None."""
    if not isinstance(name, str) or len(name) > SHOWN_LENGTH:
        return None
    # Case folded: "cpuoffloadconnector" means CPUOffloadConnector as much as a dropped letter does.
    folded = {known.casefold(): known for known in names}
    # A high cutoff: names sharing only a suffix ("...Connector") are no typo of each other.
    close = difflib.get_close_matches(name.casefold(), list(folded), n=1, cutoff=0.8)
    return folded[close[0]] if close else None


def _distribution_label(entry_point: metadata.EntryPoint) -> str:
    distribution = getattr(entry_point, "dist", None)
    if distribution is None:
        return "'<unknown distribution>'"
    return f"'{distribution.name} {distribution.version}'"


Loader = Callable[[RegisteredPlugin], Any]
"""Imports a registered name's class; the owning registry's errors are its own."""


class PluginNames:
    """The names of one kind of plug-in (`kind`: `connector`, `medium`...), each lazy."""

    def __init__(
        self,
        kind: str,
        load: Loader,
        *,
        built_ins: dict[str, tuple[str, str]],
        entry_point_group: str | None,
    ) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.providers = containers.DynamicContainer()
        self._load = load
        self._entries: dict[str, RegisteredPlugin] = {}
        self._entry_points_read = entry_point_group is None
        self._lock = threading.RLock()
        for name, (module_path, class_name) in built_ins.items():
            self._add(RegisteredPlugin(name, module_path, class_name, PluginSource.BUILT_IN))

    def copy(self, load: Loader) -> PluginNames:
        """A table with the names this one knows now, each with a fresh provider (no overrides)."""
        with self._lock:
            self._read_entry_points()
            copied = PluginNames(
                self.kind, load, built_ins={}, entry_point_group=self.entry_point_group
            )
            copied._entry_points_read = True
            for entry in self._entries.values():
                copied._add(entry)
        return copied

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Add `name` at run time; its module is imported only when the name is first used."""
        with self._lock:
            self._read_entry_points()
            if name in self._entries:
                raise ValueError(f"{self.kind.capitalize()} '{name}' is already registered.")
            self._add(RegisteredPlugin(name, module_path, class_name, PluginSource.RUNTIME))

    def get(self, name: str) -> RegisteredPlugin | None:
        self._read_entry_points()
        return self._entries.get(name)

    def __contains__(self, name: object) -> bool:
        self._read_entry_points()
        return name in self._entries

    def entries(self) -> list[RegisteredPlugin]:
        """Every registered name, built-ins first; imports nothing."""
        self._read_entry_points()
        return list(self._entries.values())

    def names(self) -> list[str]:
        return [entry.name for entry in self.entries()]

    def provider(self, name: str) -> providers.Provider[Any]:
        """The lazy provider of a registered `name` (the caller checks that it is registered)."""
        self._read_entry_points()
        provider: providers.Provider[Any] = self.providers.providers[name]
        return provider

    def _add(self, entry: RegisteredPlugin) -> None:
        self._entries[entry.name] = entry
        self.providers.set_provider(entry.name, providers.Singleton(self._load, entry))

    def _read_entry_points(self) -> None:
        with self._lock:
            if self._entry_points_read:
                return
            self._entry_points_read = True
            assert self.entry_point_group is not None
            for entry_point in metadata.entry_points(group=self.entry_point_group):
                self._add_entry_point(entry_point)

    def _add_entry_point(self, entry_point: metadata.EntryPoint) -> None:
        distribution = _distribution_label(entry_point)
        existing = self._entries.get(entry_point.name)
        if existing is not None:
            # Said out loud: an operator who installed a distribution for
            # this name must learn that it is not the one used.
            logger.warning(
                "Ignoring entry point '%s = %s' of distribution %s: %s '%s' is "
                "already registered (%s, %s)",
                entry_point.name,
                entry_point.value,
                distribution,
                self.kind,
                entry_point.name,
                existing.source.value,
                existing.target,
            )
            return
        # .module and .attr parse the value as importlib does ("pkg.mod:Cls [extra]").
        self._add(
            RegisteredPlugin(
                entry_point.name,
                entry_point.module,
                entry_point.attr or "",
                PluginSource.ENTRY_POINT,
                distribution,
            )
        )
