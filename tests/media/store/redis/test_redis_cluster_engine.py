"""The Redis connector on a Redis Cluster inside kvwire's engine, and across two engines.

The invariant of the single-server tests holds here: every request finishes
with the tokens of the same engine without a connector.
"""

from __future__ import annotations

import pathlib

import pytest

from kvwire.engine.engine import GenerationRequest
from tests.media.store.redis.test_disaggregated_prefill import assert_decode_continues_from_prefill
from tests.support.redis import (
    BLOCK_SIZE,
    LocalCluster,
    distinct_prompt_blocks,
    generate,
    generate_with_stats,
    tiny_config,
    tokens,
    with_redis,
)


def test_a_second_engine_loads_every_prompt_block_from_the_cluster(
    redis_cluster: LocalCluster,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    config = with_redis(tiny_config(), redis_cluster.url, key_prefix)
    assert tokens(generate(config, workload)) == expected_tokens

    outputs, stats = generate_with_stats(config, workload)

    assert tokens(outputs) == expected_tokens
    assert stats["blocks_loaded"] == distinct_prompt_blocks(workload, BLOCK_SIZE)
    assert stats.get("load_errors", 0) == 0
    assert all(output.local_cached_tokens + output.external_tokens == 28 for output in outputs)


def test_an_engines_blocks_are_spread_over_every_master(
    redis_cluster: LocalCluster, key_prefix: str, workload: list[GenerationRequest]
) -> None:
    generate(with_redis(tiny_config(), redis_cluster.url, key_prefix), workload)

    held = [len(node.client().keys(f"{key_prefix}*")) for node in redis_cluster.masters()]

    assert len(held) == 3
    # 17 distinct prompt blocks and the full blocks of the outputs, by slot.
    assert all(count > 0 for count in held), held
    assert sum(held) >= distinct_prompt_blocks(workload, BLOCK_SIZE)


@pytest.mark.slow
def test_the_decode_engine_continues_from_the_prefill_engines_blocks_on_a_cluster(
    redis_cluster: LocalCluster, key_prefix: str, tmp_path: pathlib.Path
) -> None:
    cluster = ["--redis-url", redis_cluster.url, "--key-prefix", key_prefix]

    assert_decode_continues_from_prefill(tmp_path, *cluster)
