"""A package's public names, each imported from its module on first use.

The import points that must stay cheap (`kvwire`, which pytest's plugin
loading imports in every project that has kvwire installed; `kvwire.engine`
and `kvwire.testing`, whose names pull in torch) re-export their names
through this one mechanism: a mapping from each name to the module that
defines it, read by the package's module-level `__getattr__` (PEP 562).
Type checkers see the names through the package's `TYPE_CHECKING` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package_globals: dict[str, Any], where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of the package whose `globals()` are given.

    Its name `n` lives in module `where[n]`; a name is imported once, then
    kept in the package's namespace.
    """
    package = package_globals["__name__"]

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        package_globals[name] = value  # looked up once
        return value

    def __dir__() -> list[str]:
        # What a user may use: the exported names and the module's dunders,
        # not the package's own private helpers.
        names = {*package_globals, *where}
        return sorted(name for name in names if not name.startswith("_") or name.startswith("__"))

    return __getattr__, __dir__
