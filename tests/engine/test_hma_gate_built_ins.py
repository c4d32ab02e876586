"""The HMA gate on a hybrid model keeps HMA on for every built-in connector, end to end.

``disable_hybrid_kv_cache_manager`` is left unset, as a user leaves it: each
built-in (and a MultiConnector of built-ins) subclasses ``SupportsHMA``, so
the engine runs the tiny hybrid model with one KV cache group per kind of
layer, through the passes ``kvwire run`` makes, and outputs stay equal.
(Redis: tests/media/store/redis/test_hma_redis_gate.py; a connector without HMA and an
explicit false: tests/engine/test_hybrid_gate.py.)
"""

from __future__ import annotations

import pathlib
from typing import Any

import attrs
import pytest

from kvwire.config import EngineConfig, KVTransferConfig
from kvwire.engine.engine import GenerationRequest
from kvwire.run.passes import compare_passes
from tests.support.engines import tiny_hybrid_config

# Two prompts of ten blocks and a half (the window is two blocks) sharing their first six.
WORKLOAD = [
    GenerationRequest(f"r{i}", tuple(range(1, 25)) + tuple(range(100 * i, 100 * i + 18)), 2)
    for i in (1, 2)
]
CPU_OFFLOAD = {
    "kv_connector": "CPUOffloadConnector",
    "kv_connector_extra_config": {"cpu_pool_bytes": "4MiB"},
}


def shared_storage(path: pathlib.Path) -> dict[str, Any]:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def hybrid_with(connector: dict[str, Any]) -> EngineConfig:
    return attrs.evolve(
        tiny_hybrid_config(), kv_transfer_config=KVTransferConfig(kv_role="kv_both", **connector)
    )


def built_in(name: str, tmp_path: pathlib.Path) -> dict[str, Any]:
    if name == "CPUOffloadConnector":
        return CPU_OFFLOAD
    if name == "SharedStorageConnector":
        return shared_storage(tmp_path / "store")
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            "connectors": [CPU_OFFLOAD, shared_storage(tmp_path / "store")]
        },
    }


@pytest.mark.parametrize(
    "name", ["CPUOffloadConnector", "SharedStorageConnector", "MultiConnector"]
)
def test_a_hybrid_model_runs_with_hma_on_and_equal_outputs(
    name: str, tmp_path: pathlib.Path
) -> None:
    report = compare_passes(hybrid_with(built_in(name, tmp_path)), WORKLOAD)

    assert report["hma"] == {
        "enabled": True,
        "reason": f"disable_hybrid_kv_cache_manager is unset and {name} supports HMA: HMA stays on",
        "kv_cache_groups": 2,
    }
    assert report["ok"], report["passes"]
    warm = report["passes"]["warm"]
    assert warm["tokens_from_connector"] > 0


def test_a_multi_connector_with_a_child_without_hma_turns_it_off_with_equal_outputs() -> None:
    plain = {
        "kv_connector": "PlainConnector",
        "kv_connector_module_path": "tests.support.engines",
    }
    connector = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [CPU_OFFLOAD, plain]},
    }

    report = compare_passes(hybrid_with(connector), WORKLOAD)

    assert report["hma"] == {
        "enabled": False,
        "reason": "disable_hybrid_kv_cache_manager is unset and MultiConnector does not "
        "support HMA: HMA is turned off",
        "kv_cache_groups": 1,
    }
    assert report["ok"], report["passes"]
    assert report["passes"]["warm"]["tokens_from_connector"] > 0
