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
    The engine's worker refills the tensors behind it every step, so it is
    only valid during the step it was made for.
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
    equal configs (in any process) compute the same bits. ``max_num_tokens``
    (the most rows a forward batch holds; default ``config.max_model_len``)
    sizes the attention buffers reused by every layer and step.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_names: Sequence[str],
        max_num_tokens: int | None = None,
    ) -> None:
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
        self.max_num_tokens = max_num_tokens or config.max_model_len
        self._workspace: _AttentionWorkspace | None = None
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
        flat_keys.index_copy_(0, metadata.slot_mapping, key.to(kv_cache.dtype))
        flat_values.index_copy_(0, metadata.slot_mapping, value.to(kv_cache.dtype))

        workspace = self._workspace_for(kv_cache)
        output = workspace.output[:num_tokens]
        for sequence in metadata.sequences:
            workspace.attend(query, kv_cache, sequence, output)
        return output

    def _workspace_for(self, kv_cache: torch.Tensor) -> _AttentionWorkspace:
        workspace = self._workspace
        block_size = kv_cache.shape[2]
        if workspace is None or workspace.block_size != block_size:
            workspace = _AttentionWorkspace(
                self.config, self.max_num_tokens, block_size, kv_cache.dtype
            )
            self._workspace = workspace
        return workspace


class _AttentionWorkspace:
    """Buffers one layer's attention reuses for every sequence, layer and step.

    Sized from the model's limits (``max_model_len`` tokens of context, the
    largest batch) except the score matrix, which grows to the largest
    query-by-context product seen: its worst case (a whole batch of queries
    against a whole context) is rarely reached and would be large.
    Each buffer's contents are consumed before the next sequence or layer
    writes it.
    """

    def __init__(
        self, config: ModelConfig, max_num_tokens: int, block_size: int, cache_dtype: torch.dtype
    ) -> None:
        self.block_size = block_size
        self.kv_heads = config.num_kv_heads
        self.group = config.num_attention_heads // config.num_kv_heads
        self.head_size = config.head_size
        self.scale = config.head_size**-0.5
        max_blocks = -(-config.max_model_len // block_size)
        max_context = max_blocks * block_size
        kv_shape = (max_blocks, block_size, self.kv_heads, self.head_size)
        self.gathered = torch.empty(kv_shape, dtype=cache_dtype)
        # Keys and values of one sequence, widened, one row of tokens per KV head.
        self.keys = torch.empty(self.kv_heads, max_context, self.head_size, dtype=_COMPUTE_DTYPE)
        self.values = torch.empty_like(self.keys)
        # Queries grouped by the KV head they share: [kv_heads, group, tokens, dim].
        self.queries = torch.empty(
            max_num_tokens * config.num_attention_heads * self.head_size, dtype=_COMPUTE_DTYPE
        )
        self.attended = torch.empty_like(self.queries)
        self.output = torch.empty(max_num_tokens, config.hidden_size, dtype=_COMPUTE_DTYPE)
        self.scores = torch.empty(0, dtype=_COMPUTE_DTYPE)
        self.mask = torch.empty(0, dtype=torch.bool)
        self.token_positions = torch.arange(max_context)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        sequence: SequenceSlice,
        output: torch.Tensor,
    ) -> None:
        """Causal attention of ``sequence``'s query rows over its context, into ``output``."""
        kv_heads, group, head_size = self.kv_heads, self.group, self.head_size
        num_queries, context_len = sequence.num_query_tokens, sequence.context_len
        rows = slice(sequence.query_start, sequence.query_start + num_queries)
        keys = self._widened_context(kv_cache[0], sequence, self.keys)
        values = self._widened_context(kv_cache[1], sequence, self.values)

        grouped_rows = group * num_queries
        queries = self.queries[: kv_heads * grouped_rows * head_size]
        queries.view(kv_heads, group, num_queries, head_size).copy_(
            query[rows].view(num_queries, kv_heads, group, head_size).permute(1, 2, 0, 3)
        )
        scores = self._grown("scores", kv_heads * grouped_rows * context_len)
        scores = scores.view(kv_heads, grouped_rows, context_len)
        torch.bmm(queries.view(kv_heads, grouped_rows, head_size), keys.transpose(1, 2), out=scores)
        scores.mul_(self.scale)
        if num_queries > 1:
            # Query i (at position first + i) sees keys at positions <= first + i.
            first = context_len - num_queries
            mask = self._grown("mask", num_queries * context_len).view(num_queries, context_len)
            torch.gt(
                self.token_positions[:context_len].unsqueeze(0),
                self.token_positions[first:context_len].unsqueeze(1),
                out=mask,
            )
            scores.view(kv_heads, group, num_queries, context_len).masked_fill_(mask, float("-inf"))
        torch._softmax(scores, -1, False, out=scores)
        attended = self.attended[: kv_heads * grouped_rows * head_size]
        torch.bmm(scores, values, out=attended.view(kv_heads, grouped_rows, head_size))
        output[rows].view(num_queries, kv_heads, group, head_size).copy_(
            attended.view(kv_heads, group, num_queries, head_size).permute(2, 0, 1, 3)
        )

    def _widened_context(
        self, cache_half: torch.Tensor, sequence: SequenceSlice, widened: torch.Tensor
    ) -> torch.Tensor:
        """The sequence's keys (or values) as ``[kv_heads, context_len, dim]`` in float64."""
        num_blocks = sequence.block_table.shape[0]
        gathered = self.gathered[:num_blocks]
        torch.index_select(cache_half, 0, sequence.block_table, out=gathered)
        context = widened[:, : sequence.context_len]
        context.copy_(
            gathered.view(-1, self.kv_heads, self.head_size)[: sequence.context_len].transpose(0, 1)
        )
        return context

    def _grown(self, name: str, size: int) -> torch.Tensor:
        buffer: torch.Tensor = getattr(self, name)
        if buffer.numel() < size:
            buffer = torch.empty(size, dtype=buffer.dtype)
            setattr(self, name, buffer)
        return buffer[:size]


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
