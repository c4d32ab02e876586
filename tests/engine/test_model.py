"""The model computes the same bits however a prompt is split into steps."""

from __future__ import annotations

import pytest
import torch

from kvwire.config import ModelConfig
from kvwire.engine.model import AttentionMetadata, SequenceSlice, TinyTransformer

BLOCK_SIZE = 4
NUM_BLOCKS = 16
LAYERS = ("layers.0.attn", "layers.1.attn")


def _caches(config: ModelConfig) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_size)
    return [torch.zeros(shape) for _ in LAYERS]


def _run_chunk(
    model: TinyTransformer, caches: list[torch.Tensor], tokens: list[int], start: int
) -> torch.Tensor:
    """Compute ``tokens`` at positions from ``start``, in blocks 0..n of the caches."""
    count = len(tokens)
    positions = torch.arange(start, start + count)
    context_blocks = -(-(start + count) // BLOCK_SIZE)
    metadata = AttentionMetadata(
        slot_mapping=positions.clone(),  # block i holds positions [4i, 4i + 4)
        positions=positions,
        sequences=(SequenceSlice(0, count, start + count, torch.arange(context_blocks)),),
    )
    return model.forward(torch.tensor(tokens), metadata, caches, torch.tensor([count - 1]))


def test_prefix_then_rest_gives_the_same_kv_and_logits_as_one_piece() -> None:
    config = ModelConfig(num_layers=2, vocab_size=300)
    model = TinyTransformer(config, LAYERS)
    prompt = [7, 42, 13, 99, 250, 3, 18, 77, 120, 5, 64, 31, 200, 11]

    whole_caches = _caches(config)
    whole_logits = _run_chunk(model, whole_caches, prompt, 0)

    split_caches = _caches(config)
    for start, end in ((0, 8), (8, 13), (13, 14)):
        split_logits = _run_chunk(model, split_caches, prompt[start:end], start)

    for whole, split in zip(whole_caches, split_caches, strict=True):
        assert torch.equal(whole, split)
    assert torch.equal(whole_logits, split_logits)


def test_two_models_from_one_seed_have_identical_weights() -> None:
    config = ModelConfig(num_layers=2, vocab_size=300, seed=5)
    first, second = TinyTransformer(config, LAYERS), TinyTransformer(config, LAYERS)
    assert torch.equal(first.embedding, second.embedding)
    assert torch.equal(first.layers[1].down, second.layers[1].down)


def test_different_seeds_give_different_models() -> None:
    first = TinyTransformer(ModelConfig(seed=1), LAYERS)
    second = TinyTransformer(ModelConfig(seed=2), LAYERS)
    assert not torch.equal(first.lm_head, second.lm_head)


def test_a_dtype_the_engine_cannot_compute_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"model_config.dtype: 'float8_e4m3fn' is not supported"):
        TinyTransformer(ModelConfig(dtype="float8_e4m3fn"), LAYERS)


def test_forward_passes_reuse_one_logits_buffer() -> None:
    config = ModelConfig(num_layers=2, vocab_size=300)
    model = TinyTransformer(config, LAYERS)
    caches = _caches(config)
    first = _run_chunk(model, caches, [7, 42, 13], 0)
    first_pointer, first_values = first.data_ptr(), first.clone()
    second = _run_chunk(model, caches, [99], 3)
    assert second.data_ptr() == first_pointer
    assert not torch.equal(second, first_values)


def test_a_batch_larger_than_the_models_buffers_is_refused_naming_the_limit() -> None:
    config = ModelConfig(num_layers=2, vocab_size=300)
    model = TinyTransformer(config, LAYERS, max_num_tokens=2)
    with pytest.raises(
        ValueError, match=r"3 tokens exceeds the model's buffers \(max_num_tokens=2\)"
    ):
        _run_chunk(model, _caches(config), [7, 42, 13], 0)


def test_decoding_in_the_batched_path_gives_the_logits_of_the_per_sequence_path() -> None:
    from kvwire.engine.paged_attention import DecodeBatch

    config = ModelConfig(num_layers=2, vocab_size=300)
    model = TinyTransformer(config, LAYERS)
    prompt = [7, 42, 13, 99, 250, 3, 18]
    caches = _caches(config)
    _run_chunk(model, caches, prompt, 0)
    per_sequence = _run_chunk(model, caches, [77], len(prompt)).clone()
    positions = torch.tensor([len(prompt)])
    metadata = AttentionMetadata(
        slot_mapping=positions.clone(),
        positions=positions,
        sequences=(),
        # Padded to three blocks, one past the context's two.
        decodes=DecodeBatch(torch.tensor([0]), torch.tensor([8]), torch.tensor([[0, 1, 5]])),
    )
    batched = model.forward(torch.tensor([77]), metadata, caches, torch.tensor([0]))
    assert torch.equal(batched, per_sequence)
