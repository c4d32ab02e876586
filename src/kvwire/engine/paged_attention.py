"""Paged attention: each sequence's queries against the keys and values in its blocks.

The cache holds keys and values in the model dtype; a sequence's context is
gathered from its blocks and widened to float64 (see `kvwire.engine.model`
for why) in buffers allocated once, and the attention runs per sequence,
since sequences of one batch have different context lengths.

Whole blocks are gathered, so the buffers also hold cache slots outside a
sequence's attention: slots past its context (a reused block keeps whatever
it held, e.g. the garbage a failed load left, NaN or any bits) and, with a
sliding window, slots before it. Their scores are masked, but a zero weight
times a NaN or infinite value is NaN, so their value rows are zeroed too:
the output never depends on what the cache holds there.
"""

from __future__ import annotations

import attrs
import torch

from kvwire.config import ModelConfig

COMPUTE_DTYPE = torch.float64


@attrs.frozen
class SequenceSlice:
    """One request's tokens in a forward batch.

    Rows `[query_start, query_start + num_query_tokens)` of the batch are
    the request's tokens at positions `[context_len - num_query_tokens,
    context_len)`; its keys and values live in `block_table`.
    """

    query_start: int
    num_query_tokens: int
    context_len: int
    block_table: torch.Tensor


@attrs.frozen
class DecodeBatch:
    """The sequences with a single query token, attended to in one batched operation.

    Decode sequence `i` is batch row `rows[i]`, with `context_lens[i]`
    tokens of context in the first blocks of `block_tables[i]`; a row's
    blocks past its context are padding (valid block ids whose keys are
    masked out).
    """

    rows: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor


@attrs.frozen
class AttentionMetadata:
    """Where a forward pass reads and writes the paged cache.

    `slot_mapping[i]` is the flat slot (`block_id * block_size + offset`)
    of batch row `i`; `sequences` (several query tokens each) and
    `decodes` (one query token each) say which rows belong to which request.
    The engine's worker refills the tensors behind it every step, so it is
    only valid during the step it was made for.
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    sequences: tuple[SequenceSlice, ...]
    decodes: DecodeBatch | None = None


class PagedAttention:
    """Causal attention of each sequence over its paged context, in reused buffers.

    One instance serves every sequence, layer and step.

    Sized from the model's limits (`max_model_len` tokens of context, the
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
        # The decode batch's buffers grow to the largest batch-by-context seen.
        self.decode_gathered = torch.empty(0, dtype=cache_dtype)
        self.decode_keys = torch.empty(0, dtype=COMPUTE_DTYPE)
        self.decode_values = torch.empty(0, dtype=COMPUTE_DTYPE)
        self.decode_queries = torch.empty(0, dtype=COMPUTE_DTYPE)
        self.decode_scores = torch.empty(0, dtype=COMPUTE_DTYPE)
        self.decode_mask = torch.empty(0, dtype=torch.bool)
        self.decode_attended = torch.empty(0, dtype=COMPUTE_DTYPE)
        self.decode_lower = torch.empty(0, dtype=torch.int64)
        self.window_mask = torch.empty(0, dtype=torch.bool)
        self.max_context = max_context
        self.token_positions = torch.arange(max_context)
        # Position p at index p + max_context: a window's first position may be negative.
        self.signed_positions = torch.arange(-max_context, max_context)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        sequence: SequenceSlice,
        output: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """Causal attention of `sequence`'s query rows over its context, into `output`.

        With `window`, the query at position p sees only positions
        `[p - window + 1, p]`; blocks wholly before the first query's
        window are not read at all (a sliding-window group holds the null
        block there).
        """
        kv_heads, group, head_size = self.kv_heads, self.group, self.head_size
        num_queries, context_len = sequence.num_query_tokens, sequence.context_len
        rows = slice(sequence.query_start, sequence.query_start + num_queries)
        first = context_len - num_queries
        if window is not None and window >= context_len:
            window = None  # every query sees its whole context anyway
        start_block = 0 if window is None else max(0, first - window + 1) // self.block_size
        key_start = start_block * self.block_size
        num_keys = context_len - key_start
        keys = self._widened_context(kv_cache[0], sequence, self.keys, start_block)
        values = self._widened_context(kv_cache[1], sequence, self.values, start_block)
        if window is not None:
            # The first block's slots before the first query's window are
            # outside every query's window (later windows start later).
            values[:, : max(0, first - window + 1 - key_start)].zero_()

        grouped_rows = group * num_queries
        queries = self.queries[: kv_heads * grouped_rows * head_size]
        queries.view(kv_heads, group, num_queries, head_size).copy_(
            query[rows].view(num_queries, kv_heads, group, head_size).permute(1, 2, 0, 3)
        )
        scores = self._grown("scores", kv_heads * grouped_rows * num_keys)
        scores = scores.view(kv_heads, grouped_rows, num_keys)
        torch.bmm(queries.view(kv_heads, grouped_rows, head_size), keys.transpose(1, 2), out=scores)
        scores.mul_(self.scale)
        if num_queries > 1 or window is not None:
            # Query i (at position first + i) sees keys at positions <= first + i
            # (and, with a window, >= first + i - window + 1).
            key_positions = self.token_positions[key_start:context_len].unsqueeze(0)
            mask = self._grown("mask", num_queries * num_keys).view(num_queries, num_keys)
            torch.gt(key_positions, self.token_positions[first:context_len].unsqueeze(1), out=mask)
            if window is not None:
                lowest = self.max_context + first - window + 1
                too_old = self._grown("window_mask", num_queries * num_keys)
                too_old = too_old.view(num_queries, num_keys)
                torch.lt(
                    key_positions,
                    self.signed_positions[lowest : lowest + num_queries].unsqueeze(1),
                    out=too_old,
                )
                torch.logical_or(mask, too_old, out=mask)
            scores.view(kv_heads, group, num_queries, num_keys).masked_fill_(mask, float("-inf"))
        torch._softmax(scores, -1, False, out=scores)
        attended = self.attended[: kv_heads * grouped_rows * head_size]
        torch.bmm(scores, values, out=attended.view(kv_heads, grouped_rows, head_size))
        output[rows].view(num_queries, kv_heads, group, head_size).copy_(
            attended.view(kv_heads, group, num_queries, head_size).permute(2, 0, 1, 3)
        )

    def attend_decodes(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        decodes: DecodeBatch,
        output: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """Attention of every single-token sequence at once, padded to the longest context.

        With `window`, a sequence's token sees only its last `window`
        positions (what lies before is masked: a sliding-window group holds
        the null block there).
        """
        kv_heads, group, head_size = self.kv_heads, self.group, self.head_size
        num_decodes, num_blocks = decodes.block_tables.shape
        context = num_blocks * self.block_size
        # Keys as [decode, kv head, dim, position] and values as [decode, kv
        # head, position, dim]: both products then run on contiguous matrices.
        keys = self._grown("decode_keys", num_decodes * kv_heads * head_size * context)
        keys = keys.view(num_decodes, kv_heads, head_size, context)
        values = self._grown("decode_values", num_decodes * kv_heads * context * head_size)
        values = values.view(num_decodes, kv_heads, context, head_size)
        for half, widened in ((0, keys.permute(0, 3, 1, 2)), (1, values.permute(0, 2, 1, 3))):
            gathered = self._grown("decode_gathered", num_decodes * context * kv_heads * head_size)
            gathered = gathered.view(num_decodes * num_blocks, self.block_size, kv_heads, head_size)
            torch.index_select(kv_cache[half], 0, decodes.block_tables.view(-1), out=gathered)
            widened.copy_(gathered.view(num_decodes, context, kv_heads, head_size))

        queries = self._grown("decode_queries", num_decodes * kv_heads * group * head_size)
        torch.index_select(
            query.view(query.shape[0], -1), 0, decodes.rows, out=queries.view(num_decodes, -1)
        )
        scores = self._grown("decode_scores", num_decodes * kv_heads * group * context)
        scores = scores.view(num_decodes, kv_heads, group, context)
        torch.matmul(queries.view(num_decodes, kv_heads, group, head_size), keys, out=scores)
        scores.mul_(self.scale)
        # Padding: positions at or past a sequence's context length.
        mask = self._grown("decode_mask", num_decodes * context).view(num_decodes, context)
        torch.ge(
            self.token_positions[:context].unsqueeze(0), decodes.context_lens.unsqueeze(1), out=mask
        )
        if window is not None and window < context:
            # The token at position length - 1 sees positions >= length - window.
            lower = self._grown("decode_lower", num_decodes)
            torch.sub(decodes.context_lens, window, out=lower)
            too_old = self._grown("window_mask", num_decodes * context).view(num_decodes, context)
            torch.lt(self.token_positions[:context].unsqueeze(0), lower.unsqueeze(1), out=too_old)
            torch.logical_or(mask, too_old, out=mask)
        scores.masked_fill_(mask.view(num_decodes, 1, 1, context), float("-inf"))
        values.masked_fill_(mask.view(num_decodes, 1, context, 1), 0.0)
        torch._softmax(scores, -1, False, out=scores)
        attended = self._grown("decode_attended", num_decodes * kv_heads * group * head_size)
        attended = attended.view(num_decodes, kv_heads, group, head_size)
        torch.matmul(scores, values, out=attended)
        output.index_copy_(0, decodes.rows, attended.view(num_decodes, -1))

    def _widened_context(
        self,
        cache_half: torch.Tensor,
        sequence: SequenceSlice,
        widened: torch.Tensor,
        start_block: int = 0,
    ) -> torch.Tensor:
        """The sequence's keys (or values) from block `start_block` on, as
        `[kv_heads, tokens, dim]` in float64."""
        block_table = sequence.block_table[start_block:]
        num_tokens = sequence.context_len - start_block * self.block_size
        gathered = self.gathered[: block_table.shape[0]]
        torch.index_select(cache_half, 0, block_table, out=gathered)
        context = widened[:, :num_tokens]
        context.copy_(gathered.view(-1, self.kv_heads, self.head_size)[:num_tokens].transpose(0, 1))
        return context

    def _grown(self, name: str, size: int) -> torch.Tensor:
        buffer: torch.Tensor = getattr(self, name)
        if buffer.numel() < size:
            buffer = torch.empty(size, dtype=buffer.dtype)
            setattr(self, name, buffer)
        return buffer[:size]
