"""vLLM loads kvwire's general plugin in every process; it imports the connector only when named.

One fresh interpreter does what a vLLM process does: `EngineArgs` loads the
general plugins, vLLM builds a configuration without a kvwire connector, then
one that names `KVWireConnector`. The kvwire modules loaded after each step
are what the tests read.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support.vllm import BLOCK_SIZE

# What the plugin and its configuration hook need, and nothing else: the
# package (its names are imported on first use), the connectors' names, the
# plugin itself.
PLUGIN_MODULES = [
    "kvwire",
    "kvwire.common",
    "kvwire.common.lazy_exports",
    "kvwire.vllm",
    "kvwire.vllm.connector_names",
    "kvwire.vllm.plugin",
]

_STEPS = textwrap.dedent(
    """
    import json, sys

    from vllm.engine.arg_utils import EngineArgs

    def kvwire_modules():
        return sorted(name for name in sys.modules if name.split(".")[0] == "kvwire")

    def engine_args(**kwargs):
        return EngineArgs(
            model=sys.argv[1], dtype="float32", block_size=int(sys.argv[2]),
            max_model_len=2048, enforce_eager=True, **kwargs,
        )

    loaded = {}
    args = engine_args()  # loads vLLM's general plugins
    loaded["plugins"] = kvwire_modules()
    args.create_engine_config()
    loaded["without"] = kvwire_modules()
    engine_args(kv_transfer_config={
        "kv_connector": "KVWireConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvwire_profile": "cpu-offload"},
    }).create_engine_config()
    loaded["named"] = kvwire_modules()
    print(json.dumps(loaded))
    """
)


@pytest.fixture(scope="module")
def loaded_modules(tiny_model: str) -> dict[str, list[str]]:
    """The kvwire modules loaded after each step, by step."""
    result = subprocess.run(
        [sys.executable, "-c", _STEPS, tiny_model, str(BLOCK_SIZE)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    steps: dict[str, list[str]] = json.loads(result.stdout.strip().splitlines()[-1])
    return steps


@pytest.mark.slow
def test_loading_vllm_s_plugins_imports_only_kvwire_s_plugin(
    loaded_modules: dict[str, list[str]],
) -> None:
    assert loaded_modules["plugins"] == PLUGIN_MODULES


@pytest.mark.slow
def test_a_configuration_without_a_kvwire_connector_imports_nothing_more(
    loaded_modules: dict[str, list[str]],
) -> None:
    assert loaded_modules["without"] == PLUGIN_MODULES


@pytest.mark.slow
def test_a_configuration_naming_kvwire_s_connector_imports_it_to_check_the_profile(
    loaded_modules: dict[str, list[str]],
) -> None:
    named = set(loaded_modules["named"])

    assert {"kvwire.vllm.connector", "kvwire.vllm.startup_check"} <= named
    assert set(PLUGIN_MODULES) < named
