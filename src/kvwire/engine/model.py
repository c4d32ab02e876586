"""A small decoder-only transformer that reads and writes a paged KV cache.

Embedding, RMSNorm, rotary positions, grouped-query attention and a gated
MLP, with weights drawn from `ModelConfig.seed`; greedy decoding happens in
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
from typing import Protocol

import attrs
import torch

from kvwire.common.redaction import shown
from kvwire.config import ModelConfig
from kvwire.config.dtypes import DTYPES
from kvwire.engine.paged_attention import (
    COMPUTE_DTYPE,
    AttentionMetadata,
    PagedAttention,
    SequenceSlice,
)

__all__ = [
    "AttentionMetadata",
    "LayerHook",
    "RankExchange",
    "SequenceSlice",
    "TinyTransformer",
    "torch_dtype",
]

_COMPUTE_DTYPE = COMPUTE_DTYPE
_ROPE_BASE = 10000.0
_RMS_EPS = 1e-6


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a model dtype name; the engine's cache holds this dtype."""
    dtype = DTYPES.get(name)
    if dtype is None or not dtype.engine_computes:
        computed = [known.name for known in DTYPES.values() if known.engine_computes]
        raise ValueError(
            f"model_config.dtype: {shown(name)} is not supported by the kvwire engine; "
            f"use one of {', '.join(computed)}"
        )
    return dtype.torch_dtype()


# Called around each layer's attention with the layer's name: before it reads
# the cache, and after it has written this step's keys and values.
LayerHook = Callable[[str], None]


class RankExchange(Protocol):
    """How one rank of a parallel model trades activations with the others.

    `gather_heads`: this rank's attention output (its query heads, `[tokens,
    local heads * head_size]`) beside every tensor rank's, as `[tokens,
    heads * head_size]` in head order (a buffer the next call overwrites).
    `send_hidden` / `receive_hidden`: the residual stream to the next
    pipeline stage, from the previous one.
    """

    def gather_heads(self, local: torch.Tensor) -> torch.Tensor: ...

    def send_hidden(self, hidden: torch.Tensor) -> None: ...

    def receive_hidden(self, hidden: torch.Tensor) -> None: ...


def _round(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype).to(_COMPUTE_DTYPE)


class TinyTransformer:
    """A deterministic decoder-only transformer over a paged KV cache.

    Weights are drawn once from `config.seed`; two instances built from
    equal configs (in any process) compute the same bits. `max_num_tokens`
    (the most rows a forward batch holds; default `config.max_model_len`)
    sizes the attention buffers reused by every layer and step.
    `layer_names` are in model order; `layer_groups` gives each layer's
    KV cache group (default: all in group 0), whose attention metadata it
    reads. A layer `config.layer_types` names sliding attends only within
    `config.sliding_window`, whatever its group.

    One rank of a parallel engine computes a share: the KV heads
    `kv_heads` (and the query heads that attend to them) of the model's
    `layers` (`layer_names` names them), trading activations through
    `exchange`. Its weights are the whole model's, drawn the same way and
    sliced, and every rank computes each head exactly as an unsplit model
    does: the heads' attention outputs are gathered before the output
    projection, so the tokens are the same at every parallel size. A stage
    that is not the last returns no logits (None): it sends its residual
    stream on.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_names: Sequence[str],
        max_num_tokens: int | None = None,
        layer_groups: Sequence[int] | None = None,
        *,
        kv_heads: range | None = None,
        layers: range | None = None,
        exchange: RankExchange | None = None,
    ) -> None:
        self.config = config
        self.layer_names = tuple(layer_names)
        kv_heads = kv_heads or range(config.num_kv_heads)
        layers = layers or range(len(self.layer_names))
        if len(layers) != len(self.layer_names):
            raise ValueError(
                f"layers names {len(layers)} layers but layer_names {len(self.layer_names)}"
            )
        is_split = len(kv_heads) < config.num_kv_heads or len(layers) < config.num_layers
        if is_split and exchange is None:
            raise ValueError("a share of the model (kv_heads, layers) needs an exchange")
        self._exchange = exchange
        self._gathers_heads = len(kv_heads) < config.num_kv_heads
        self._is_first_stage = layers.start == 0
        self._is_last_stage = layers.stop >= config.num_layers
        group = config.num_attention_heads // config.num_kv_heads
        # The model as this rank's attention sees it: its heads only.
        self.heads_config = attrs.evolve(
            config, num_kv_heads=len(kv_heads), num_attention_heads=len(kv_heads) * group
        )
        self.layer_groups = tuple(layer_groups or [0] * len(self.layer_names))
        if len(self.layer_groups) != len(self.layer_names):
            raise ValueError(
                f"layer_groups has {len(self.layer_groups)} entries for "
                f"{len(self.layer_names)} layers; give one group index per layer"
            )
        self.layer_windows = tuple(config.layer_window(index) for index in layers)
        self.dtype = torch_dtype(config.dtype)
        generator = torch.Generator().manual_seed(config.seed)
        hidden = config.hidden_size
        kv_width = config.num_kv_heads * config.head_size
        head_size = config.head_size
        query_columns = slice(kv_heads.start * group * head_size, kv_heads.stop * group * head_size)
        kv_columns = slice(kv_heads.start * head_size, kv_heads.stop * head_size)

        def weight(*shape: int) -> torch.Tensor:
            # Drawn in the model dtype, so every weight is exactly representable
            # there, then widened for the computation.
            fan_in = shape[0]
            drawn = torch.randn(*shape, generator=generator, dtype=torch.float32)
            return _round(drawn / fan_in**0.5, self.dtype)

        self.embedding = _round(
            torch.randn(config.vocab_size, hidden, generator=generator), self.dtype
        )
        self.layers = []
        # Every layer's weights are drawn, in model order, so a share's are
        # the very ones an unsplit model draws; it keeps its own.
        for index in range(config.num_layers):
            drawn = _LayerWeights(
                query=weight(hidden, hidden)[:, query_columns].contiguous(),
                key=weight(hidden, kv_width)[:, kv_columns].contiguous(),
                value=weight(hidden, kv_width)[:, kv_columns].contiguous(),
                output=weight(hidden, hidden),
                gate=weight(hidden, config.intermediate_size),
                up=weight(hidden, config.intermediate_size),
                down=weight(config.intermediate_size, hidden),
            )
            if index in layers:
                self.layers.append(drawn)
        self.lm_head = weight(hidden, config.vocab_size)
        self.max_num_tokens = max_num_tokens or config.max_model_len
        self._rows = _RowBuffers(self.heads_config, config, self.max_num_tokens, self.dtype)
        self._paged_attention: PagedAttention | None = None
        half = config.head_size // 2
        self._inverse_frequencies = 1.0 / (
            _ROPE_BASE ** (torch.arange(half, dtype=_COMPUTE_DTYPE) / max(half, 1))
        )

    def forward(
        self,
        token_ids: torch.Tensor,
        metadata: AttentionMetadata | Sequence[AttentionMetadata],
        kv_caches: Sequence[torch.Tensor],
        sample_rows: torch.Tensor,
        before_attention: LayerHook | None = None,
        after_attention: LayerHook | None = None,
    ) -> torch.Tensor | None:
        """Run the batch through every layer; the logits of `sample_rows`.

        Writes this step's keys and values into `kv_caches` (one tensor per
        layer, `[2, num_blocks, block_size, num_kv_heads, head_size]`, of
        this rank's heads). `metadata` is one per KV cache group (a single
        one serves group 0). The logits live in a buffer the next call
        overwrites; a pipeline stage before the last returns None.
        """
        per_group = (metadata,) if isinstance(metadata, AttentionMetadata) else metadata
        rows = self._rows
        num_tokens = token_ids.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"a forward batch of {num_tokens} tokens exceeds the model's buffers "
                f"(max_num_tokens={self.max_num_tokens})"
            )
        hidden = rows.take("hidden", num_tokens)
        if self._is_first_stage:
            torch.index_select(self.embedding, 0, token_ids, out=hidden)
        else:
            assert self._exchange is not None  # checked when built
            self._exchange.receive_hidden(hidden)
        self._rotary(per_group[0].positions)
        layers = zip(
            self.layer_names,
            self.layers,
            kv_caches,
            self.layer_groups,
            self.layer_windows,
            strict=True,
        )
        for name, weights, kv_cache, group, window in layers:
            if before_attention is not None:
                before_attention(name)
            attention_out = self._attention(
                rows.rms_norm(hidden), weights, kv_cache, per_group[group], window
            )
            if after_attention is not None:
                after_attention(name)
            self._add_rounded(hidden, attention_out, weights.output)
            normed = rows.rms_norm(hidden)
            gate = torch.matmul(normed, weights.gate, out=rows.take("gate", num_tokens))
            torch.nn.functional.silu(gate, inplace=True)
            gate.mul_(torch.matmul(normed, weights.up, out=rows.take("up", num_tokens)))
            self._add_rounded(hidden, gate, weights.down)
        if not self._is_last_stage:
            assert self._exchange is not None  # checked when built
            self._exchange.send_hidden(hidden)
            return None
        sampled = rows.take("sampled", sample_rows.shape[0])
        torch.index_select(hidden, 0, sample_rows, out=sampled)
        final = rows.rms_norm(sampled, "sampled_normed")
        return torch.matmul(final, self.lm_head, out=rows.take("logits", sample_rows.shape[0]))

    def _add_rounded(
        self, hidden: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor
    ) -> None:
        """`hidden += inputs @ weight`, then rounded to the model dtype (the residual stream)."""
        num_tokens = hidden.shape[0]
        hidden.add_(torch.matmul(inputs, weight, out=self._rows.take("projected", num_tokens)))
        rounding = self._rows.take("rounding", num_tokens)
        rounding.copy_(hidden)
        hidden.copy_(rounding)

    def _rotary(self, positions: torch.Tensor) -> None:
        rows = self._rows
        num_tokens = positions.shape[0]
        angles = rows.take("angles", num_tokens)
        torch.mul(positions.unsqueeze(1), self._inverse_frequencies.unsqueeze(0), out=angles)
        torch.cos(angles, out=rows.take("cos", num_tokens))
        torch.sin(angles, out=rows.take("sin", num_tokens))

    def _apply_rotary(self, states: torch.Tensor) -> None:
        """Rotate `states` (`[tokens, heads, head_size]`) in place by their positions."""
        rows = self._rows
        num_tokens, heads, _head_size = states.shape
        half = self._inverse_frequencies.shape[0]
        cos = rows.take("cos", num_tokens).unsqueeze(1)
        sin = rows.take("sin", num_tokens).unsqueeze(1)
        first, second = states[..., :half], states[..., half : 2 * half]
        first_sin = rows.take_flat("rotary_first", num_tokens * heads * half).view(first.shape)
        second_sin = rows.take_flat("rotary_second", num_tokens * heads * half).view(first.shape)
        torch.mul(first, sin, out=first_sin)
        torch.mul(second, sin, out=second_sin)
        # first' = first cos - second sin; second' = first sin + second cos.
        first.mul_(cos).sub_(second_sin)
        second.mul_(cos).add_(first_sin)

    def _attention(
        self,
        normed: torch.Tensor,
        weights: _LayerWeights,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        window: int | None,
    ) -> torch.Tensor:
        config = self.heads_config
        rows = self._rows
        num_tokens = normed.shape[0]
        heads, kv_heads, head_size = (
            config.num_attention_heads,
            config.num_kv_heads,
            config.head_size,
        )
        query = torch.matmul(normed, weights.query, out=rows.take("query", num_tokens))
        query = query.view(num_tokens, heads, head_size)
        self._apply_rotary(query)
        # The cache is the single source of keys and values: this step's rows
        # are written first and read back with the loaded/cached ones.
        for half, projection in enumerate((weights.key, weights.value)):
            states = torch.matmul(normed, projection, out=rows.take("kv", num_tokens))
            states = states.view(num_tokens, kv_heads, head_size)
            if half == 0:
                self._apply_rotary(states)
            narrowed = rows.take("kv_narrow", num_tokens).view(num_tokens, kv_heads, head_size)
            narrowed.copy_(states)
            flat = kv_cache[half].view(-1, kv_heads, head_size)
            flat.index_copy_(0, metadata.slot_mapping, narrowed)

        attention = self._attention_for(kv_cache)
        output = attention.output[:num_tokens]
        for sequence in metadata.sequences:
            attention.attend(query, kv_cache, sequence, output, window)
        if metadata.decodes is not None:
            attention.attend_decodes(query, kv_cache, metadata.decodes, output, window)
        if self._gathers_heads:
            assert self._exchange is not None  # checked when built
            return self._exchange.gather_heads(output)
        return output

    def _attention_for(self, kv_cache: torch.Tensor) -> PagedAttention:
        attention = self._paged_attention
        block_size = kv_cache.shape[2]
        if attention is None or attention.block_size != block_size:
            attention = PagedAttention(
                self.heads_config, self.max_num_tokens, block_size, kv_cache.dtype
            )
            self._paged_attention = attention
        return attention


class _RowBuffers:
    """A forward pass's per-row activations, allocated once and reused by every layer and step.

    Each buffer holds `max_num_tokens` rows; `take` gives the first
    `num_rows`. A buffer's contents are consumed before it is taken again.
    `heads` is the model as this rank's attention sees it (its heads),
    `config` the whole model.
    """

    def __init__(
        self, heads: ModelConfig, config: ModelConfig, max_num_tokens: int, dtype: torch.dtype
    ) -> None:
        hidden, kv_width = config.hidden_size, heads.num_kv_heads * heads.head_size
        half = config.head_size // 2
        widths = {
            "hidden": hidden,
            "normed": hidden,
            "projected": hidden,
            "query": heads.num_attention_heads * heads.head_size,
            "kv": kv_width,
            "gate": config.intermediate_size,
            "up": config.intermediate_size,
            "angles": half,
            "cos": half,
            "sin": half,
            "rotary_first": heads.num_attention_heads * half,
            "rotary_second": heads.num_attention_heads * half,
            "variance": 1,
            "sampled": hidden,
            "sampled_normed": hidden,
            "logits": config.vocab_size,
        }
        self._buffers = {
            name: torch.empty(max_num_tokens, width, dtype=_COMPUTE_DTYPE)
            for name, width in widths.items()
        }
        # The model dtype: rounding the residual stream, and keys/values for the cache.
        self._buffers["rounding"] = torch.empty(max_num_tokens, hidden, dtype=dtype)
        self._buffers["kv_narrow"] = torch.empty(max_num_tokens, kv_width, dtype=dtype)

    def take(self, name: str, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows of buffer `name`."""
        return self._buffers[name][:num_rows]

    def take_flat(self, name: str, num_elements: int) -> torch.Tensor:
        """The first `num_elements` elements of buffer `name`, for reshaping."""
        return self._buffers[name].view(-1)[:num_elements]

    def rms_norm(self, states: torch.Tensor, into: str = "normed") -> torch.Tensor:
        """`states` RMS-normalised into buffer `into`."""
        num_rows = states.shape[0]
        normed = self.take(into, num_rows)
        variance = self.take("variance", num_rows)
        torch.mul(states, states, out=normed)
        torch.mean(normed, dim=-1, keepdim=True, out=variance)
        variance.add_(_RMS_EPS).rsqrt_()
        return torch.mul(states, variance, out=normed)


@attrs.frozen
class _LayerWeights:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
