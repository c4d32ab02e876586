"""Old module names import the module that replaced them, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import importlib.machinery
import subprocess
import sys
import types
import warnings

import pytest

from kvwire._moved import MOVED_MODULES

# The moves whose new module imports without torch (the rest need the torch extra).
TORCH_FREE = ("kvwire.kv_cache_config", "kvwire.profile", "kvwire.connector.types")


def import_fresh(name: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Import ``name`` as a first import would, whatever earlier tests imported."""
    for loaded in list(sys.modules):
        if loaded == name or loaded.startswith(name + "."):
            monkeypatch.delitem(sys.modules, loaded)
    return importlib.import_module(name)


def check_moved(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new = importlib.import_module(MOVED_MODULES[old])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stand_in = import_fresh(old, monkeypatch)
    said = f"{old} moved to {MOVED_MODULES[old]}; "
    assert [w.category for w in caught if said in str(w.message)] == [DeprecationWarning]
    public = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
    assert public
    for name in public:
        assert getattr(stand_in, name) is getattr(new, name)
    # The new module keeps its own name.
    assert new.__spec__ is not None and new.__spec__.name == MOVED_MODULES[old]


@pytest.mark.parametrize("old", TORCH_FREE)
def test_an_old_module_name_imports_the_new_module_with_a_deprecation_warning(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_moved(old, monkeypatch)


@pytest.mark.torch
@pytest.mark.parametrize("old", sorted(set(MOVED_MODULES) - set(TORCH_FREE)))
def test_every_moved_module_imports_by_its_old_name(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_moved(old, monkeypatch)


# Their parents (kvwire.media, kvwire.engine) need the torch extra.
@pytest.mark.torch
@pytest.mark.parametrize(
    "old", sorted(old for old in MOVED_MODULES if old.rpartition(".")[0] not in MOVED_MODULES)
)
def test_an_old_name_never_hides_a_module_that_exists(old: str) -> None:
    parent = importlib.import_module(old.rpartition(".")[0])
    assert importlib.machinery.PathFinder.find_spec(old, list(parent.__path__)) is None


def test_from_import_of_an_old_name_works_and_points_at_the_caller() -> None:
    # A fresh interpreter: the warning must be shown by default, at the user's line.
    code = "from kvwire.kv_cache_config import KVCacheConfig\nprint(KVCacheConfig.__module__)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "kvwire.config.kv_cache"
    assert "<string>:1: DeprecationWarning: kvwire.kv_cache_config moved to" in result.stderr


def test_a_name_that_never_existed_still_fails_to_import() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("kvwire.no_such_module")
