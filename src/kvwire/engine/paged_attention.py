"""Paged attention: each sequence's queries against the keys and values in its blocks.

The cache holds keys and values in the model dtype; a sequence's context is
gathered from its blocks and widened to float64 (see :mod:`kvwire.engine.model`
for why) in buffers allocated once, and the attention runs per sequence,
since sequences of one batch have different context lengths.
"""

from __future__ import annotations

import attrs
import torch

from kvwire.config import ModelConfig

COMPUTE_DTYPE = torch.float64


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


class PagedAttention:
    """Causal attention of each sequence over its paged context, in reused buffers.

    One instance serves every sequence, layer and step.

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
        self.keys = torch.empty(self.kv_heads, max_context, self.head_size, dtype=COMPUTE_DTYPE)
        self.values = torch.empty_like(self.keys)
        # Queries grouped by the KV head they share: [kv_heads, group, tokens, dim].
        self.queries = torch.empty(
            max_num_tokens * config.num_attention_heads * self.head_size, dtype=COMPUTE_DTYPE
        )
        self.attended = torch.empty_like(self.queries)
        self.output = torch.empty(max_num_tokens, config.hidden_size, dtype=COMPUTE_DTYPE)
        self.scores = torch.empty(0, dtype=COMPUTE_DTYPE)
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
