"""The HMA gate keeps HMA on for the Redis connectors on a hybrid model, end to end.

As tests/engine/test_hma_gate_built_ins.py for the other built-ins: the tiny
hybrid model through the passes ``kvwire run`` makes, with
``disable_hybrid_kv_cache_manager`` unset, against a real server (and a
real local cluster), alone and behind CPU offload in a MultiConnector.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.run.passes import compare_passes
from tests.engine.test_hma_gate_built_ins import CPU_OFFLOAD, WORKLOAD, hybrid_with
from tests.support.redis import LocalCluster, RedisServer


def redis_connector(url: str, key_prefix: str) -> dict[str, Any]:
    return {
        "kv_connector": "RedisConnector",
        "kv_connector_extra_config": {
            "url": url,
            "key_prefix": key_prefix,
            "max_save_bytes_in_flight": "1MiB",
        },
    }


def assert_hma_on_and_equal_outputs(connector: dict[str, Any]) -> None:
    report = compare_passes(hybrid_with(connector), WORKLOAD)

    name = connector["kv_connector"]
    assert report["hma"] == {
        "enabled": True,
        "reason": f"disable_hybrid_kv_cache_manager is unset and {name} supports HMA: HMA stays on",
        "kv_cache_groups": 2,
    }
    assert report["ok"], report["passes"]
    assert report["passes"]["warm"]["tokens_from_connector"] > 0


@pytest.mark.parametrize("behind_cpu_offload", [False, True], ids=["alone", "tiered"])
def test_redis_runs_a_hybrid_model_with_hma_on(
    redis_server: RedisServer, key_prefix: str, behind_cpu_offload: bool
) -> None:
    connector = redis_connector(redis_server.url, key_prefix)
    if behind_cpu_offload:
        connector = {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [CPU_OFFLOAD, connector]},
        }
    assert_hma_on_and_equal_outputs(connector)


@pytest.mark.slow
def test_redis_cluster_runs_a_hybrid_model_with_hma_on(
    redis_cluster: LocalCluster, key_prefix: str
) -> None:
    assert_hma_on_and_equal_outputs(redis_connector(redis_cluster.url, key_prefix))
