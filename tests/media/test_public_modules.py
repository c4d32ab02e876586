"""kvwire.media's exports live in public modules; no medium imports another's private ones."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import kvwire.media

MEDIA = Path(kvwire.media.__file__).parent


def _public_modules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(kvwire.media.__path__, "kvwire.media.")
        if not any(part.startswith("_") for part in info.name.split("."))
    ]


@pytest.mark.parametrize("module", ["kvwire.media", *_public_modules()])
def test_every_class_a_public_module_exports_is_defined_in_a_public_module(module: str) -> None:
    pytest.importorskip("torch")
    loaded = importlib.import_module(module)

    private = [
        f"{name}: {value.__module__}"
        for name in getattr(loaded, "__all__", ())
        if isinstance(value := getattr(loaded, name), type) and "._" in value.__module__
    ]

    assert private == []


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return imported


@pytest.mark.parametrize("medium", ["cpu_pool", "peer", "store"])
def test_a_medium_imports_only_public_modules_of_other_media(medium: str) -> None:
    own = f"kvwire.media.{medium}"
    private = sorted(
        f"{path.relative_to(MEDIA)}: {module}"
        for path in (MEDIA / medium).rglob("*.py")
        for module in _imported_modules(path)
        if module.startswith("kvwire.media.")
        and not module.startswith(own + ".")
        and any(part.startswith("_") for part in module.split("."))
    )

    assert private == []
