"""A small decoder-only transformer that reads and writes a paged KV cache.

Embedding, RMSNorm, rotary positions, grouped-query attention and a gated
MLP, with weights drawn from ``ModelConfig.seed``; greedy decoding happens in
the worker.

Why the arithmetic is float64 with rounding to the model dtype: a CPU matmul
does not give a row the same bits when the batch around it changes (the BLAS
kernel and its reduction order depend on the shapes), so a prompt computed in
one piece and the same prompt computed as "loaded prefix + new tokens" would
differ in the last bits. Computing every sub-layer in float64 and rounding the
residual stream and the stored keys and values to the model dtype absorbs
those ~1e-16 differences: measured on torch 2.13 CPU, zero differing elements
in 1.5M after rounding. So the KV a connector stores is exactly the KV the
engine would have computed itself, and tokens generated with a connector
equal tokens generated without one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from kvwire.config import ModelConfig

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_COMPUTE_DTYPE = torch.float64
_ROPE_BASE = 10000.0
_RMS_EPS = 1e-6


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a model dtype name; the engine's cache holds this dtype."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"model_config.dtype: {name!r} is not supported by the kvwire engine; "
            f"use one of {', '.join(_TORCH_DTYPES)}"
        ) from None


@attrs.frozen
class SequenceSlice:
    """One request's tokens in a forward batch.

    Rows ``[query_start, query_start + num_query_tokens)`` of the batch are
    the request's tokens at positions ``[context_len - num_query_tokens,
    context_len)``; its keys and values live in ``block_table``.
    """

    query_start: int
    num_query_tokens: int
    context_len: int
    block_table: torch.Tensor


@attrs.frozen
class AttentionMetadata:
    """Where a forward pass reads and writes the paged cache.

    ``slot_mapping[i]`` is the flat slot (``block_id * block_size + offset``)
    of batch row ``i``; ``sequences`` says which rows belong to which request.
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    sequences: tuple[SequenceSlice, ...]


# Called around each layer's attention with the layer's name: before it reads
# the cache, and after it has written this step's keys and values.
LayerHook = Callable[[str], None]


def _round(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype).to(_COMPUTE_DTYPE)


class TinyTransformer:
    """A deterministic decoder-only transformer over a paged KV cache.

    Weights are drawn once from ``config.seed``; two instances built from
    equal configs (in any process) compute the same bits.
    """

    def __init__(self, config: ModelConfig, layer_names: Sequence[str]) -> None:
        self.config = config
        self.layer_names = tuple(layer_names)
        self.dtype = torch_dtype(config.dtype)
        generator = torch.Generator().manual_seed(config.seed)
        hidden = config.hidden_size
        kv_width = config.num_kv_heads * config.head_size

        def weight(*shape: int) -> torch.Tensor:
            # Drawn in the model dtype, so every weight is exactly representable
            # there, then widened for the computation.
            fan_in = shape[0]
            drawn = torch.randn(*shape, generator=generator, dtype=torch.float32)
            return _round(drawn / fan_in**0.5, self.dtype)

        self.embedding = _round(
            torch.randn(config.vocab_size, hidden, generator=generator), self.dtype
        )
        self.layers = [
            _LayerWeights(
                query=weight(hidden, hidden),
                key=weight(hidden, kv_width),
                value=weight(hidden, kv_width),
                output=weight(hidden, hidden),
                gate=weight(hidden, config.intermediate_size),
                up=weight(hidden, config.intermediate_size),
                down=weight(config.intermediate_size, hidden),
            )
            for _ in self.layer_names
        ]
        self.lm_head = weight(hidden, config.vocab_size)
        self._attention_buffer: torch.Tensor | None = None
        half = config.head_size // 2
        self._inverse_frequencies = 1.0 / (
            _ROPE_BASE ** (torch.arange(half, dtype=_COMPUTE_DTYPE) / max(half, 1))
        )

    def forward(
        self,
        token_ids: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        sample_rows: torch.Tensor,
        before_attention: LayerHook | None = None,
        after_attention: LayerHook | None = None,
    ) -> torch.Tensor:
        """Run the batch through every layer; the logits of ``sample_rows``.

        Writes this step's keys and values into ``kv_caches`` (one tensor per
        layer, ``[2, num_blocks, block_size, num_kv_heads, head_size]``).
        """
        hidden_states = self.embedding[token_ids]
        cos, sin = self._rotary(metadata.positions)
        for name, weights, kv_cache in zip(self.layer_names, self.layers, kv_caches, strict=True):
            if before_attention is not None:
                before_attention(name)
            attention_out = self._attention(
                _rms_norm(hidden_states), weights, kv_cache, metadata, cos, sin
            )
            if after_attention is not None:
                after_attention(name)
            hidden_states = _round(hidden_states + attention_out @ weights.output, self.dtype)
            normed = _rms_norm(hidden_states)
            gated = torch.nn.functional.silu(normed @ weights.gate) * (normed @ weights.up)
            hidden_states = _round(hidden_states + gated @ weights.down, self.dtype)
        final = _rms_norm(hidden_states[sample_rows])
        return final @ self.lm_head

    def _attention_output(self, num_tokens: int) -> torch.Tensor:
        # One buffer for every layer and step, grown to the largest batch seen:
        # each layer's attention output is consumed before the next layer runs.
        buffer = self._attention_buffer
        if buffer is None or buffer.shape[0] < num_tokens:
            buffer = torch.empty(num_tokens, self.config.hidden_size, dtype=_COMPUTE_DTYPE)
            self._attention_buffer = buffer
        return buffer[:num_tokens]

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(_COMPUTE_DTYPE)[:, None] * self._inverse_frequencies[None, :]
        return torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]

    def _attention(
        self,
        normed: torch.Tensor,
        weights: _LayerWeights,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        config = self.config
        num_tokens = normed.shape[0]
        heads, kv_heads, head_size = (
            config.num_attention_heads,
            config.num_kv_heads,
            config.head_size,
        )
        query = _apply_rotary((normed @ weights.query).view(num_tokens, heads, head_size), cos, sin)
        key = _apply_rotary((normed @ weights.key).view(num_tokens, kv_heads, head_size), cos, sin)
        value = (normed @ weights.value).view(num_tokens, kv_heads, head_size)
        # The cache is the single source of keys and values: this step's rows
        # are written first and read back with the loaded/cached ones.
        flat_keys = kv_cache[0].view(-1, kv_heads, head_size)
        flat_values = kv_cache[1].view(-1, kv_heads, head_size)
        flat_keys[metadata.slot_mapping] = key.to(kv_cache.dtype)
        flat_values[metadata.slot_mapping] = value.to(kv_cache.dtype)

        output = self._attention_output(num_tokens)
        group = heads // kv_heads
        scale = head_size**-0.5
        for sequence in metadata.sequences:
            rows = slice(sequence.query_start, sequence.query_start + sequence.num_query_tokens)
            context_keys = kv_cache[0][sequence.block_table].view(-1, kv_heads, head_size)
            context_values = kv_cache[1][sequence.block_table].view(-1, kv_heads, head_size)
            context_keys = context_keys[: sequence.context_len].to(_COMPUTE_DTYPE)
            context_values = context_values[: sequence.context_len].to(_COMPUTE_DTYPE)
            context_keys = context_keys.repeat_interleave(group, dim=1)
            context_values = context_values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", query[rows], context_keys) * scale
            first_position = sequence.context_len - sequence.num_query_tokens
            query_positions = torch.arange(first_position, sequence.context_len)[:, None]
            key_positions = torch.arange(sequence.context_len)[None, :]
            scores.masked_fill_(key_positions > query_positions, float("-inf"))
            probabilities = torch.softmax(scores, dim=-1)
            attended = torch.einsum("hqk,khd->qhd", probabilities, context_values)
            output[rows] = attended.reshape(sequence.num_query_tokens, heads * head_size)
        return output


@attrs.frozen
class _LayerWeights:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def _rms_norm(hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(dim=-1, keepdim=True)
    return hidden_states * torch.rsqrt(variance + _RMS_EPS)


def _apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    first, second = states[..., :half], states[..., half : 2 * half]
    rotated = torch.cat(
        (first * cos - second * sin, first * sin + second * cos, states[..., 2 * half :]), dim=-1
    )
    return rotated
