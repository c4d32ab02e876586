"""Redis Cluster entries that outlive the pipeline split: PP=2 and PP=1 engines load each other's.

With ``entry_layers: 1`` an entry holds one layer of a block, whichever
stage wrote it, so an engine split into two pipeline stages (one worker
process each) and an unsplit one share every entry through a real local
cluster (three masters, three replicas).
"""

from __future__ import annotations

import attrs
import pytest

from kvwire.config import EngineConfig, ModelConfig, ParallelConfig
from kvwire.engine.engine import LLMEngine
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.engines import generate, served, tiny_config, tokens
from tests.support.redis import BLOCK_SIZE, LocalCluster, with_redis

pytestmark = pytest.mark.slow

# Prompts that share nothing: the engine's own prefix cache serves none of a
# prompt, so the reader's loads are every full block of every prompt.
WORKLOAD = synthetic_workload(
    WorkloadSpec(
        num_requests=4, prompt_len=30, output_len=5, shared_prefix_ratio=0.0, vocab_size=300, seed=7
    )
)


def engine(redis_cluster: LocalCluster, key_prefix: str, **sizes: int) -> EngineConfig:
    """Three layers (stages of two and one at PP=2), one layer an entry, on the cluster."""
    model = ModelConfig(num_layers=3, vocab_size=300, max_model_len=512)
    config = attrs.evolve(
        tiny_config(), model_config=model, parallel_config=ParallelConfig(**sizes)
    )
    return with_redis(
        config, redis_cluster.url, key_prefix, entry_layers=1, max_save_bytes_in_flight="1MiB"
    )


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    model = ModelConfig(num_layers=3, vocab_size=300, max_model_len=512)
    return tokens(generate(attrs.evolve(tiny_config(), model_config=model), WORKLOAD))


@pytest.mark.parametrize(
    ("writer", "reader"),
    [({"pipeline_parallel_size": 2}, {}), ({}, {"pipeline_parallel_size": 2})],
    ids=["pp2-to-pp1", "pp1-to-pp2"],
)
def test_entries_one_pipeline_split_wrote_load_into_the_other(
    redis_cluster: LocalCluster,
    key_prefix: str,
    reference: list[tuple[int, ...]],
    writer: dict[str, int],
    reader: dict[str, int],
) -> None:
    written = generate(engine(redis_cluster, key_prefix, **writer), WORKLOAD)
    assert tokens(written) == reference
    assert served(written) == 0

    with LLMEngine(engine(redis_cluster, key_prefix, **reader)) as reading:
        loaded = reading.generate(WORKLOAD)
        stats = dict(reading.connector_stats.data)

    assert tokens(loaded) == reference
    # Every request's full prompt blocks (all but the last token's) came from the
    # other split's entries.
    assert served(loaded) == sum(
        (len(request.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE for request in WORKLOAD
    )
    assert stats["blocks_loaded"] > 0
    assert "load_errors" not in stats
