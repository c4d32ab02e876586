"""Old module names that still import, for one release, with a `DeprecationWarning`.

When a public module moves, code that imports it by its old name keeps
working until the release after the one that moved it: the old name imports
a stand-in whose attributes are the new module's, and the import warns with
the new name. `MOVED_MODULES` is the one list of such names;
CHANGELOG.md says in which release each goes.

A stand-in, not the new module itself under a second name: the import system
would otherwise rewrite the new module's `__spec__` with the old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Mapping, Sequence

__all__ = ["MOVED_MODULES", "install_moved_module_finder"]

MOVED_MODULES: Mapping[str, str] = {
    "kvwire.connector": "kvwire.interface",
    "kvwire.connector.base": "kvwire.interface.base",
    "kvwire.connector.counters": "kvwire.interface.counters",
    "kvwire.connector.roles": "kvwire.interface.roles",
    "kvwire.connector.types": "kvwire.interface.types",
    "kvwire.connector.worker_steps": "kvwire.connectors.offload.worker_steps",
    "kvwire.connectors.cpu_offload": "kvwire.connectors.offload.presets",
    "kvwire.connectors.redis": "kvwire.connectors.offload.presets",
    "kvwire.connectors.shared_storage": "kvwire.connectors.offload.presets",
    "kvwire.dtypes": "kvwire.config.dtypes",
    "kvwire.engine.passes": "kvwire.run.passes",
    "kvwire.engine.report": "kvwire.run.report",
    "kvwire.engine.run": "kvwire.run.command",
    "kvwire.extra_config": "kvwire.config.extra_config",
    "kvwire.interface.worker_steps": "kvwire.connectors.offload.worker_steps",
    "kvwire.kv_cache_config": "kvwire.config.kv_cache",
    "kvwire.media.directory": "kvwire.media.store.directory",
    "kvwire.media.faulty": "kvwire.testing.faulty_medium",
    "kvwire.media.faulty.handler": "kvwire.testing.faulty_medium.handler",
    "kvwire.media.faulty.medium": "kvwire.testing.faulty_medium.medium",
    "kvwire.media.directory.medium": "kvwire.media.store.directory.medium",
    "kvwire.media.redis": "kvwire.media.store.redis",
    "kvwire.media.redis.medium": "kvwire.media.store.redis.medium",
    "kvwire.medium_registry": "kvwire.registry.media",
    "kvwire.memory_limits": "kvwire.config.memory_limits",
    "kvwire.profile": "kvwire.config.profile",
    "kvwire.profile_yaml": "kvwire.config.profile_yaml",
}
"""Each old module name, and the module that now holds what it held."""

# Old names under which others moved: their stand-ins are packages.
_OLD_PACKAGES = frozenset(old.rpartition(".")[0] for old in MOVED_MODULES) & set(MOVED_MODULES)


class _StandIn(types.ModuleType):
    """An old module name whose every attribute is the new module's."""

    def __init__(self, old: str, new: types.ModuleType) -> None:
        super().__init__(old, new.__doc__)
        self._kvwire_new_module = new

    def __getattr__(self, name: str) -> object:
        return getattr(self._kvwire_new_module, name)

    def __dir__(self) -> list[str]:
        return sorted({*dir(self._kvwire_new_module), *super().__dir__()})


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self._new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self._new}; import it from there: the old name goes in "
            "the next release",
            DeprecationWarning,
            # warn() -> create_module() -> the import system's frames -> the import.
            stacklevel=2,
        )
        stand_in = _StandIn(spec.name, importlib.import_module(self._new))
        if spec.name in _OLD_PACKAGES:
            # So that the moved modules under it can be imported by their old names.
            stand_in.__path__ = []
        return stand_in

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the stand-in reads the new module."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _MovedModuleLoader(new), is_package=fullname in _OLD_PACKAGES
        )


def install_moved_module_finder() -> None:
    """Let the old names in `MOVED_MODULES` import (once per process; last in line)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
