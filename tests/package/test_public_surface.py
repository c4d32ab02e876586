"""The import points a user needs: kvwire, kvwire.media, kvwire.testing, kvwire.exceptions.

kvwire.vllm, the fifth, is checked in tests/vllm, where vLLM is installed.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# kvwire and kvwire.exceptions resolve every name without the torch extra:
# kvwire.media's `BlockMemory` needs torch, the conformance kit the engine.
_IMPORT_POINTS = (
    "kvwire",
    pytest.param("kvwire.media", marks=pytest.mark.torch),
    pytest.param("kvwire.testing", marks=pytest.mark.torch),
    "kvwire.exceptions",
)


@pytest.mark.parametrize("module_name", _IMPORT_POINTS)
def test_every_public_name_of_an_import_point_resolves(module_name: str) -> None:
    module = importlib.import_module(module_name)

    missing = [name for name in module.__all__ if getattr(module, name, None) is None]

    assert missing == []
    assert list(module.__all__) == sorted(module.__all__)


def test_the_quick_start_needs_only_the_kvwire_package() -> None:
    import kvwire

    for name in (
        "KVConnectorContainer",
        "KVConnectorRole",
        "KVWireError",
        "container_for_profile",
        "declare_role",
        "build_full_attention_kv_cache_config",
        "HMADecision",
        "default_registry",
    ):
        assert name in kvwire.__all__


def test_an_unknown_exception_name_is_an_attribute_error() -> None:
    import kvwire.exceptions

    with pytest.raises(AttributeError, match="NoSuchError"):
        _ = kvwire.exceptions.NoSuchError


@pytest.mark.parametrize(
    "module_name", [pytest.param("kvwire.media", marks=pytest.mark.torch), "kvwire.exceptions"]
)
def test_an_import_point_imports_no_torch_and_no_built_in_medium(module_name: str) -> None:
    probe = (
        f"import sys, {module_name}\n"
        "print(sorted(m for m in sys.modules if m in ('torch', 'redis') or m.startswith("
        "('kvwire.media.cpu_pool', 'kvwire.media.store.directory', 'kvwire.media.store.redis', "
        "'kvwire.connectors'))))\n"
    )

    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )

    assert result.stdout.strip() == "[]"


@pytest.mark.torch
def test_every_public_exception_kvwire_defines_is_defined_in_kvwire_exceptions() -> None:
    import kvwire.exceptions
    from tests.exceptions.test_errors_under_kvwire_error import kvwire_exception_classes

    public = {
        cls
        for cls in kvwire_exception_classes()
        if not cls.__name__.startswith("_") and not cls.__module__.startswith("tests.")
    }

    elsewhere = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in public
        if cls.__module__ != "kvwire.exceptions"
    )
    assert elsewhere == []
    assert {cls.__name__ for cls in public} <= set(kvwire.exceptions.__all__)


def test_every_name_kvwire_exceptions_exports_is_an_error_defined_there() -> None:
    import kvwire.exceptions

    exported = [getattr(kvwire.exceptions, name) for name in kvwire.exceptions.__all__]

    not_errors = [cls for cls in exported if not isinstance(cls, type)]
    assert not_errors == []
    defined_elsewhere = [cls for cls in exported if cls.__module__ != "kvwire.exceptions"]
    assert defined_elsewhere == []
    outside = [
        cls.__name__ for cls in exported if not issubclass(cls, kvwire.exceptions.KVWireError)
    ]
    assert outside == []


def test_kvwires_pytest_plugin_costs_a_project_that_does_not_use_it_nothing(
    tmp_path: Path,
) -> None:
    # pytest loads the plugin (entry point pytest11) in every project that has
    # kvwire installed: it imports no more of kvwire than the package itself.
    probe = (
        "import sys, kvwire.testing.plugin\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('kvwire', 'torch', 'redis', 'dependency_injector', 'attrs', 'cattrs', 'yaml')))\n"
    )
    imported = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    (tmp_path / "test_unrelated.py").write_text("def test_nothing():\n    pass\n")
    session = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_unrelated.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        timeout=120,
    )

    assert imported.stdout.split() == [
        "['kvwire',",
        "'kvwire.common',",
        "'kvwire.common.lazy_exports',",
        "'kvwire.testing',",
        "'kvwire.testing.plugin']",
    ]
    # Nothing of the plugin's own in the output (pytest's header, left out by -q,
    # lists every installed plugin by name).
    assert "kvwire" not in session.stdout.lower().replace(str(tmp_path).lower(), "")


# Where an author looks for a name: each documented import point but kvwire.vllm (tests/vllm).
_AUTHOR_IMPORT_POINTS = ("kvwire", "kvwire.media", "kvwire.testing", "kvwire.exceptions")


def _public_names() -> dict[str, object]:
    names: dict[str, object] = {}
    for module_name in (*_AUTHOR_IMPORT_POINTS, "kvwire.engine"):
        module = importlib.import_module(module_name)
        names.update((f"{module_name}.{name}", getattr(module, name)) for name in module.__all__)
    return names


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in dotted.split("."))


@pytest.mark.torch
def test_every_public_class_is_defined_in_a_public_module() -> None:
    # What help(), tracebacks and the API reference show as its home.
    homes = sorted(
        f"{name} is {value.__module__}.{value.__qualname__}"
        for name, value in _public_names().items()
        if isinstance(value, type)
        and name.split(".")[0] == "kvwire"
        and not name.startswith("kvwire.engine.")
        and _is_private(value.__module__)
    )

    assert homes == []


def _annotated_types(annotation: object) -> Iterator[type]:
    if isinstance(annotation, type):
        yield annotation
    origin = typing.get_origin(annotation)
    if isinstance(origin, type):
        yield origin
    for argument in typing.get_args(annotation):
        yield from _annotated_types(argument)


def _signatures(value: object) -> Iterator[tuple[str, Callable[..., object]]]:
    if not isinstance(value, type):
        if callable(value):
            yield "", value
        return
    for attribute, member in vars(value).items():
        if attribute.startswith("_") and attribute != "__init__":
            continue
        if isinstance(member, (classmethod, staticmethod)):
            member = member.__func__
        if isinstance(member, property):
            member = member.fget
        if inspect.isfunction(member):
            yield f".{attribute}", member


@pytest.mark.torch
def test_every_type_a_public_signature_names_is_public_too() -> None:
    import torch

    public = _public_names()
    reachable = {id(value) for value in public.values()}
    # The names the modules import for type checking only, resolved as the checker does.
    namespace = {name.rpartition(".")[2]: value for name, value in public.items()}
    namespace["torch"] = torch
    unreachable: set[str] = set()
    for name, value in public.items():
        if name.startswith("kvwire.engine."):
            continue
        for member, function in _signatures(value):
            try:
                hints = typing.get_type_hints(function, localns=namespace)
            except NameError as unknown:  # a type imported for type checking, exported nowhere
                unreachable.add(f"{name}{member} names {unknown.name}")
                continue
            for annotated in (t for hint in hints.values() for t in _annotated_types(hint)):
                if annotated.__module__.split(".")[0] == "kvwire" and (
                    id(annotated) not in reachable or _is_private(annotated.__module__)
                ):
                    unreachable.add(
                        f"{name}{member} names {annotated.__module__}.{annotated.__name__}"
                    )

    assert sorted(unreachable) == []


def _only_public_names_in_dir(package: object) -> None:
    names = dir(package)
    assert set(package.__all__) <= set(names), package  # type: ignore[attr-defined]
    private = [name for name in names if name.startswith("_") and not name.startswith("__")]
    assert private == [], package


def test_dir_of_kvwire_lists_only_public_names() -> None:
    import kvwire

    _only_public_names_in_dir(kvwire)


@pytest.mark.torch
def test_dir_of_the_other_import_points_lists_only_public_names() -> None:
    import kvwire.engine
    import kvwire.media
    import kvwire.testing

    for package in (kvwire.engine, kvwire.media, kvwire.testing):
        _only_public_names_in_dir(package)
