"""Every exception class kvwire defines derives from KVWireError (and keeps its builtin base)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil

import pytest

import kvwire
from kvwire.exceptions import KVWireError

pytestmark = pytest.mark.torch

# Packages whose modules need an optional dependency this venv may lack; the
# condition is explicit, as in tests/conftest.py. tests/vllm checks kvwire.vllm
# in the venv that has vLLM.
_NEEDS = {"kvwire.vllm": "vllm"}


def _import_every_module() -> list[str]:
    imported = []
    for module in pkgutil.walk_packages(kvwire.__path__, prefix="kvwire."):
        needed = next(
            (dist for package, dist in _NEEDS.items() if module.name.startswith(package)), None
        )
        if needed is not None and importlib.util.find_spec(needed) is None:
            continue
        importlib.import_module(module.name)
        imported.append(module.name)
    return imported


def kvwire_exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in kvwire's modules, nested and private ones included."""
    _import_every_module()
    found: list[type[BaseException]] = []
    pending: list[type[BaseException]] = [BaseException]
    seen: set[type[BaseException]] = set()
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
                if sub.__module__.split(".")[0] == "kvwire":
                    found.append(sub)
    return found


def test_every_exception_kvwire_defines_derives_from_kvwire_error() -> None:
    classes = kvwire_exception_classes()
    # The walk sees classes from every corner of the package.
    names = {cls.__name__ for cls in classes}
    assert {"ProfileYAMLError", "CorruptBlockError", "JobAbandoned"} <= names
    outside = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in classes
        if not issubclass(cls, KVWireError)
    )
    assert outside == []


def test_kvwire_errors_keep_the_builtin_base_callers_catch() -> None:
    from kvwire.exceptions import (
        CorruptBlockError,
        DeadlineExceeded,
        ExtraConfigError,
        FileChangedError,
        ProfileYAMLError,
        WorkerProcessError,
    )

    assert issubclass(CorruptBlockError, ValueError)
    assert issubclass(ExtraConfigError, ValueError)
    assert issubclass(ProfileYAMLError, ValueError)
    assert issubclass(WorkerProcessError, RuntimeError)
    # The Redis store counts both among a server's outage errors.
    assert issubclass(DeadlineExceeded, TimeoutError)
    assert issubclass(FileChangedError, OSError)


# Each error by the module that raises it: user code imports it from there too.
_RAISED_IN = {
    "ConnectorBuildTimeout": "kvwire.container",
    "CorruptBlockError": "kvwire.blocks.format",
    "DeadlineExceeded": "kvwire.media.store.redis._wire",
    "ExtraConfigError": "kvwire.config.extra_config",
    "FileChangedError": "kvwire.identity.file_digests",
    "FileRefused": "kvwire.config.bounded_file",
    "LateWriteError": "kvwire.media.store.base",
    "MacKeyError": "kvwire.blocks.mac",
    "ModelIdentityError": "kvwire.identity.model",
    "ModulePathError": "kvwire.registry.connectors",
    "NIXLUnavailableError": "kvwire.media.peer._agent",
    "PluginExit": "kvwire.common.plugin_calls",
    "ProfileYAMLError": "kvwire.config.profile_yaml",
    "RedisSettingsError": "kvwire.media.store.redis.settings",
    "RoleViolationError": "kvwire.testing.instruments",
    "ServerUnavailable": "kvwire.media.outage",
    "StoreReplyError": "kvwire.media.store.base",
    "UnknownMediumError": "kvwire.registry.media",
    "UnreadableWeightsError": "kvwire.identity.model",
    "ValueRefused": "kvwire.config.extra_config",
    "WorkerProcessError": "kvwire.engine.worker_process",
}


@pytest.mark.parametrize(("name", "module_name"), sorted(_RAISED_IN.items()))
def test_an_error_imported_from_the_module_that_raises_it_is_kvwire_exceptions_class(
    name: str, module_name: str
) -> None:
    import kvwire.exceptions

    raised_from = getattr(importlib.import_module(module_name), name)

    assert raised_from is getattr(kvwire.exceptions, name)
