"""A model whose layers are all sliding-window: one KV cache group, with a null block."""

from __future__ import annotations

import pathlib

import attrs

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine
from tests.support.engines import generate, shared_storage, tiny_hybrid_config, tokens


def _sliding_only() -> EngineConfig:
    config = tiny_hybrid_config()
    model = attrs.evolve(config.model_config, layer_types=("sliding_attention",) * 4)
    return attrs.evolve(config, model_config=model)


def test_entries_saved_at_a_branch_point_whose_window_was_nulled_load_right(
    tmp_path: pathlib.Path,
) -> None:
    base = _sliding_only()
    prompt = tuple((7 * i + 3) % 300 for i in range(41))  # 10 full blocks + 1
    short = prompt[:21]  # 5 full blocks + 1
    reference = tokens(generate(base, [GenerationRequest("ref", short, 4)]))
    config = shared_storage(base, tmp_path)
    with LLMEngine(config) as engine:  # saves the long prompt's window at its end
        assert engine.hma_enabled
        assert len(engine.kv_cache_config.kv_cache_groups) == 1
        engine.generate([GenerationRequest("long", prompt, 1)])
        engine.wait_for_saves()
    before = {path for path in tmp_path.rglob("*") if path.is_file()}
    with LLMEngine(config) as engine:
        engine.generate([GenerationRequest("short", short, 1)])
        engine.wait_for_saves()
        # The medium loses the short prompt's window; this engine keeps it locally,
        # so the long prompt branches there, and its window there has left the
        # window of what it loads: those positions hold the null block.
        for path in {path for path in tmp_path.rglob("*") if path.is_file()} - before:
            path.unlink()
        engine.generate([GenerationRequest("long-again", prompt, 6)])
        engine.wait_for_saves()
    with LLMEngine(config) as engine:  # a cold local cache: whatever loads comes from disk
        [warm] = engine.generate([GenerationRequest("short-warm", short, 4)])

    assert warm.output_token_ids == reference[0]
