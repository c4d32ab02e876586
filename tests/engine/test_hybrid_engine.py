"""A hybrid model (sliding-window and full-attention layers) end to end on the engine.

With HMA on the cache has two KV cache groups and a sliding-window group
gives back what left its window; with HMA off one group keeps every block.
Attention is windowed either way, so the generated tokens are the same.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from kvwire.config import EngineConfig, ModelConfig
from kvwire.config.kv_cache import (
    FullAttentionSpec,
    SlidingWindowSpec,
    build_kv_cache_config,
)
from kvwire.config.profile import load_profile
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.engine.workload import WorkloadSpec, synthetic_workload
from tests.support.engines import tiny_hybrid_config, tokens


def _workload() -> list[GenerationRequest]:
    """Prompts of about 40 tokens, far beyond the window of 8, most sharing a prefix."""
    spec = WorkloadSpec(
        num_requests=8, prompt_len=40, output_len=6, shared_prefix_ratio=0.6, vocab_size=300, seed=3
    )
    return synthetic_workload(spec)


def _twice(config: EngineConfig, **options: object) -> tuple[LLMEngine, list[RequestOutput]]:
    """The workload, then the same prompts again (local prefix hits), on one engine."""
    workload = _workload()
    again = [attrs.evolve(r, request_id=f"{r.request_id}/again") for r in workload]
    with LLMEngine(config, **options) as engine:  # type: ignore[arg-type]
        outputs = engine.generate(workload) + engine.generate(again)
    return engine, outputs


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    """Tokens with HMA off: one group, every block kept."""
    engine, outputs = _twice(tiny_hybrid_config(disable_hybrid_kv_cache_manager=True))
    assert not engine.hma_enabled and len(engine.kv_cache_config.kv_cache_groups) == 1
    return tokens(outputs)


def test_with_hma_on_the_cache_has_a_full_and_a_sliding_group_and_outputs_are_unchanged(
    reference: list[tuple[int, ...]],
) -> None:
    engine, outputs = _twice(tiny_hybrid_config())
    groups = engine.kv_cache_config.kv_cache_groups
    assert engine.hma_enabled
    assert [type(group.kv_cache_spec) for group in groups] == [FullAttentionSpec, SlidingWindowSpec]
    assert tokens(outputs) == reference
    # The repeated prompts were local prefix hits.
    assert sum(output.local_cached_tokens for output in outputs[8:]) > 0


def test_outputs_are_unchanged_without_prefix_caching(reference: list[tuple[int, ...]]) -> None:
    _engine, outputs = _twice(tiny_hybrid_config(enable_prefix_caching=False))
    assert tokens(outputs) == reference
    assert sum(output.local_cached_tokens for output in outputs) == 0


def test_outputs_are_unchanged_when_a_small_pool_forces_preemptions(
    reference: list[tuple[int, ...]],
) -> None:
    engine, outputs = _twice(tiny_hybrid_config(num_gpu_blocks=40))
    assert engine.counters.preemptions > 0
    assert tokens(outputs) == reference


def test_outputs_are_unchanged_when_prompts_are_computed_in_chunks(
    reference: list[tuple[int, ...]],
) -> None:
    _engine, outputs = _twice(tiny_hybrid_config(max_num_batched_tokens=7))
    assert tokens(outputs) == reference


@pytest.mark.slow
def test_outputs_are_unchanged_with_the_worker_in_its_own_process(
    reference: list[tuple[int, ...]],
) -> None:
    _engine, outputs = _twice(tiny_hybrid_config(), worker_mode="process")
    assert tokens(outputs) == reference


def test_the_window_changes_what_the_model_computes(reference: list[tuple[int, ...]]) -> None:
    config = tiny_hybrid_config()
    all_full = attrs.evolve(config.model_config, layer_types=(), sliding_window=None)
    _engine, outputs = _twice(attrs.evolve(config, model_config=all_full))
    assert tokens(outputs) != reference


def test_every_pool_block_is_free_again_after_the_run_and_none_is_the_null_block() -> None:
    engine, _outputs = _twice(tiny_hybrid_config(num_gpu_blocks=40))
    manager = engine.scheduler.block_manager
    assert manager.uses_null_block and manager.num_free_blocks == 39
    assert engine.reset_prefix_cache()


def test_groups_share_the_cache_tensors_layer_by_layer() -> None:
    with LLMEngine(tiny_hybrid_config()) as engine:
        caches = engine.worker.kv_caches  # type: ignore[attr-defined]
        assert caches["layers.0.attn"].data_ptr() == caches["layers.1.attn"].data_ptr()
        assert caches["layers.2.attn"].data_ptr() == caches["layers.3.attn"].data_ptr()
        assert caches["layers.0.attn"].data_ptr() != caches["layers.2.attn"].data_ptr()


def test_captured_kv_of_full_layers_is_unchanged_and_sliding_layers_keep_their_window() -> None:
    prompt = tuple(range(1, 41))
    request = [GenerationRequest("r", prompt, 2)]
    with LLMEngine(tiny_hybrid_config(), capture_kv=True) as engine:
        engine.generate(request)
        hma = engine.captured_kv["r"]
    off = tiny_hybrid_config(disable_hybrid_kv_cache_manager=True)
    with LLMEngine(off, capture_kv=True) as engine:
        engine.generate(request)
        every_block = engine.captured_kv["r"]
    full_layers, sliding_layers = [1, 3], [0, 2]
    assert torch.equal(hma[full_layers], every_block[full_layers])
    # The last step computed position 40, which attends [33, 40]: before it
    # the first 8 blocks (32 tokens) were given back (they read as zeros).
    assert torch.equal(hma[sliding_layers][:, :, 32:], every_block[sliding_layers][:, :, 32:])
    assert not hma[sliding_layers][:, :, :32].any()


def test_the_hybrid_preset_lays_out_two_groups_of_two_layers() -> None:
    from kvwire.engine.presets import apply_preset

    config = apply_preset(EngineConfig(), "hybrid")
    layout = build_kv_cache_config(config, hma_enabled=True)
    groups = [(group.layer_names, group.kv_cache_spec) for group in layout.kv_cache_groups]
    assert [names for names, _spec in groups] == [
        ["layers.1.attn", "layers.3.attn"],
        ["layers.0.attn", "layers.2.attn"],
    ]
    assert groups[1][1] == SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, sliding_window=128
    )
    assert [tensor.shared_by for tensor in layout.kv_cache_tensors] == [
        ["layers.1.attn", "layers.0.attn"],
        ["layers.3.attn", "layers.2.attn"],
    ]
    assert len(build_kv_cache_config(config, hma_enabled=False).kv_cache_groups) == 1


def test_unequal_kinds_are_cut_into_groups_of_equal_size() -> None:
    # Gemma 3's pattern: five sliding layers to one full one.
    model = ModelConfig(
        num_layers=6,
        layer_types=("sliding_attention",) * 5 + ("full_attention",),
        sliding_window=8,
    )
    layout = build_kv_cache_config(EngineConfig(model_config=model), hma_enabled=True)
    assert [group.layer_names for group in layout.kv_cache_groups] == [
        ["layers.5.attn"],
        *[[f"layers.{index}.attn"] for index in range(5)],
    ]
    assert len(layout.kv_cache_tensors) == 1 and len(layout.kv_cache_tensors[0].shared_by) == 6


def test_a_model_without_sliding_layers_keeps_one_full_attention_group() -> None:
    layout = build_kv_cache_config(EngineConfig(), hma_enabled=True)
    assert len(layout.kv_cache_groups) == 1
    assert isinstance(layout.kv_cache_groups[0].kv_cache_spec, FullAttentionSpec)


def test_layer_types_and_sliding_window_come_from_a_profile() -> None:
    config = load_profile(
        {
            "model_config": {
                "num_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"],
                "sliding_window": 16,
            }
        }
    )
    assert config.model_config.layer_types == ("sliding_attention", "full_attention")
    assert config.model_config.is_hybrid


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries but num_layers is 2"),
        (
            {"layer_types": ["full_attention", "local"]},
            r"layer_types: entry 1 is 'local', not one of full_attention, sliding_attention",
        ),
        (
            {"layer_types": ["sliding_attention", "full_attention"]},
            "sliding_window is not set",
        ),
        ({"sliding_window": 0}, "sliding_window must be > 0"),
        (
            {"sliding_window": 8},
            "sliding_window is 8 but layer_types names no sliding_attention layer",
        ),
        (
            {"layer_types": ["full_attention"] * 2, "sliding_window": 8},
            "sliding_window is 8 but layer_types names no sliding_attention layer",
        ),
    ],
)
def test_a_bad_hybrid_profile_names_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_profile({"model_config": {"num_layers": 2, **fields}})


def test_a_request_is_checked_against_the_blocks_its_groups_need() -> None:
    # 40 + 6 tokens: 12 blocks in each group (one step may compute the whole
    # prompt, so the sliding group may need them all at once), 24 blocks of
    # the 23 a pool of 24 has besides the null block.
    refused = pytest.raises(ValueError, match=r"needs 24 blocks .* \(one is the null block\)")
    with LLMEngine(tiny_hybrid_config(num_gpu_blocks=24)) as engine, refused:
        engine.add_request(GenerationRequest("r", tuple(range(40)), 6))
