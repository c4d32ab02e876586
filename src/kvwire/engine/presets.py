"""Model sizes for the engine: tiny for tests, larger ones for benchmarks.

A preset replaces a profile's `model_config` (`kvwire run --preset`);
the seed and dtype of the profile are kept.
"""

from __future__ import annotations

import attrs

from kvwire.common.redaction import shown
from kvwire.config import FULL_ATTENTION, SLIDING_ATTENTION, EngineConfig, ModelConfig

HYBRID_LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
"""The hybrid presets' layers: sliding-window and full attention alternating."""

_TINY = ModelConfig(
    num_layers=2, num_attention_heads=4, num_kv_heads=2, head_size=16, intermediate_size=128
)
_BENCH = ModelConfig(
    num_layers=4,
    num_attention_heads=8,
    num_kv_heads=2,
    head_size=64,
    intermediate_size=1024,
    vocab_size=2048,
    max_model_len=4096,
)

MODEL_PRESETS: dict[str, ModelConfig] = {
    # Fast enough that a whole test workload runs in a fraction of a second.
    "tiny": _TINY,
    # A real-shaped small model: attention dominates long prompts, as it does on a GPU.
    "bench": _BENCH,
    # The bench shape with sliding-window layers (as Gemma 2/3 alternate them):
    # with HMA on, two KV cache groups, and a window shorter than long prompts.
    "hybrid": attrs.evolve(_BENCH, layer_types=HYBRID_LAYER_TYPES, sliding_window=128),
    # The tiny shape, hybrid (four layers, to alternate twice): a window of 8
    # tokens (two blocks of 4 before the prefix end), so test prompts of a few
    # dozen tokens leave it.
    "tiny-hybrid": attrs.evolve(
        _TINY, num_layers=4, layer_types=HYBRID_LAYER_TYPES, sliding_window=8
    ),
}


def apply_preset(config: EngineConfig, preset: str) -> EngineConfig:
    """`config` with the preset's model shape (keeping its seed and dtype)."""
    try:
        shape = MODEL_PRESETS[preset]
    except KeyError:
        raise ValueError(
            f"preset: {shown(preset)} is not one of {', '.join(MODEL_PRESETS)}"
        ) from None
    model = attrs.evolve(shape, seed=config.model_config.seed, dtype=config.model_config.dtype)
    return attrs.evolve(config, model_config=model)
