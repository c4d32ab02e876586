"""What each rank of a parallel engine holds and its connector sees, and the layouts refused."""

from __future__ import annotations

import attrs
import pytest

from kvwire.config import EngineConfig, ModelConfig, ParallelConfig
from kvwire.config.kv_cache import build_kv_cache_config
from kvwire.engine.engine import LLMEngine
from kvwire.engine.parallel import rank_share, stage_bounds
from kvwire.engine.presets import apply_preset
from tests.support.engines import tiny_config


def _config(layers: int = 5, kv_heads: int = 2, **sizes: int) -> EngineConfig:
    model = ModelConfig(num_layers=layers, num_kv_heads=kv_heads, vocab_size=300, max_model_len=512)
    return attrs.evolve(tiny_config(), model_config=model, parallel_config=ParallelConfig(**sizes))


def test_stages_split_the_layers_evenly_the_extra_ones_before_the_last() -> None:
    assert stage_bounds(5, 2) == (0, 3, 5)
    assert stage_bounds(7, 3) == (0, 2, 5, 7)  # 2, 3, 2 layers, as vLLM splits
    assert stage_bounds(4, 4) == (0, 1, 2, 3, 4)


def test_each_rank_holds_its_heads_of_its_stage_s_layers() -> None:
    config = _config(tensor_parallel_size=2, pipeline_parallel_size=2)
    whole = build_kv_cache_config(config)
    share = rank_share(config, whole, 3)  # tensor rank 1 of stage 1
    assert (share.kv_heads, share.query_heads, share.layers) == (
        range(1, 2),
        range(2, 4),
        range(3, 5),
    )
    assert share.layer_names == ("layers.3.attn", "layers.4.attn")
    assert share.kv_cache_config.layer_names == ["layers.3.attn", "layers.4.attn"]
    assert share.kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads == 1
    assert share.kv_cache_config.num_blocks == whole.num_blocks
    seen = share.connector_config
    assert (seen.model_config.num_kv_heads, seen.model_config.num_layers) == (1, 2)
    assert seen.parallel_config.rank == 3
    assert seen.parallel_config.pipeline_layers == (0, 3, 5)
    # Entries name the whole model at every parallel size.
    assert seen.model_config.weights_identity == config.model_config.weights_identity


@pytest.mark.parametrize(
    ("config", "options", "message"),
    [
        (
            _config(kv_heads=2, tensor_parallel_size=4),
            {},
            r"parallel_config.tensor_parallel_size: 4 does not divide model_config.num_kv_heads",
        ),
        (
            _config(layers=2, pipeline_parallel_size=3),
            {},
            r"parallel_config.pipeline_parallel_size: 3 stages for model_config.num_layers 2",
        ),
        (
            _config(tensor_parallel_size=2, rank=1),
            {},
            r"parallel_config.rank: 1, but the kvwire engine numbers its ranks itself",
        ),
        (
            _config(tensor_parallel_size=2, world_size=4),
            {},
            r"parallel_config.world_size: 4",
        ),
        (
            _config(tensor_parallel_size=2),
            {"worker_mode": "inline"},
            r"worker_mode: inline runs one worker",
        ),
    ],
    ids=["heads", "stages", "rank", "world-size", "inline"],
)
def test_a_layout_the_engine_cannot_run_is_refused_by_name(
    config: EngineConfig, options: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLMEngine(config, **options)  # type: ignore[arg-type]


def test_pipeline_stages_over_several_kv_cache_groups_are_refused_by_name() -> None:
    config = attrs.evolve(
        apply_preset(tiny_config(), "tiny-hybrid"),
        parallel_config=ParallelConfig(pipeline_parallel_size=2),
    )
    hybrid_cache = build_kv_cache_config(config, hma_enabled=True)
    with pytest.raises(ValueError, match=r"set scheduler_config.disable_hybrid_kv_cache_manager"):
        rank_share(config, hybrid_cache, 0)
    # One group of every layer (HMA off): each stage holds its layers.
    assert rank_share(config, build_kv_cache_config(config, False), 1).layers == range(2, 4)
