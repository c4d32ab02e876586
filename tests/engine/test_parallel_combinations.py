"""The engine split both ways at once, and a hybrid model split over heads.

Tensor and pipeline parallelism together run four worker processes (two
stages of two head ranks); a sliding-window model at TP=2 splits the heads
of both its KV cache groups. Each engine computes the unsplit engine's
tokens without a connector, saves through shared storage, and after its
prefix cache is emptied is served its own entries on every rank.
"""

from __future__ import annotations

import pathlib

import attrs
import pytest

from kvwire.config import EngineConfig, ModelConfig, ParallelConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.engines import (
    generate,
    renamed,
    served,
    shared_storage,
    tiny_config,
    tiny_hybrid_config,
    tokens,
)

pytestmark = pytest.mark.slow

WORKLOAD = synthetic_workload(
    WorkloadSpec(
        num_requests=4, prompt_len=40, output_len=5, shared_prefix_ratio=0.6, vocab_size=300, seed=7
    )
)


def _split(config: EngineConfig, **sizes: int) -> EngineConfig:
    return attrs.evolve(config, parallel_config=ParallelConfig(**sizes))


def _cold_then_warm(
    config: EngineConfig,
) -> tuple[LLMEngine, list[RequestOutput], list[RequestOutput]]:
    with LLMEngine(config) as engine:
        cold = engine.generate(WORKLOAD)
        engine.wait_for_saves()
        engine.reset_prefix_cache()
        warm = engine.generate(renamed(WORKLOAD, "warm"))
    return engine, cold, warm


def _assert_served_unchanged(
    cold: list[RequestOutput], warm: list[RequestOutput], workload: list[GenerationRequest]
) -> None:
    reference_ids = [request.request_id for request in workload]
    assert [output.request_id for output in cold] == reference_ids
    assert served(cold) == 0
    assert served(warm) > 0
    assert sum(output.num_load_failures for output in warm) == 0


def test_tp2_by_pp2_runs_four_ranks_with_the_unsplit_tokens_and_is_served_warm(
    tmp_path: pathlib.Path,
) -> None:
    model = attrs.evolve(
        tiny_config(), model_config=ModelConfig(num_layers=3, vocab_size=300, max_model_len=512)
    )
    reference = tokens(generate(model, WORKLOAD))
    split = _split(model, tensor_parallel_size=2, pipeline_parallel_size=2)
    engine, cold, warm = _cold_then_warm(shared_storage(split, tmp_path))
    # Ranks are laid out stage by stage: each stage's two ranks hold half the heads.
    assert [share.layers for share in engine.shares] == [range(0, 2)] * 2 + [range(2, 3)] * 2
    assert [share.kv_heads for share in engine.shares] == [range(0, 1), range(1, 2)] * 2
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    _assert_served_unchanged(cold, warm, WORKLOAD)


def test_a_hybrid_model_at_tp2_keeps_both_groups_and_the_unsplit_tokens_and_is_served_warm(
    tmp_path: pathlib.Path,
) -> None:
    model = tiny_hybrid_config()
    reference = tokens(generate(model, WORKLOAD))
    engine, cold, warm = _cold_then_warm(
        shared_storage(_split(model, tensor_parallel_size=2), tmp_path)
    )
    assert engine.hma_enabled
    assert [share.kv_heads for share in engine.shares] == [range(0, 1), range(1, 2)]
    for share in engine.shares:
        assert len(share.kv_cache_config.kv_cache_groups) == 2
    assert tokens(cold) == reference
    assert tokens(warm) == reference
    _assert_served_unchanged(cold, warm, WORKLOAD)
