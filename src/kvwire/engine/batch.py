"""The worker's per-step inputs, laid into tensors allocated once.

A step's token ids, positions, slot mapping, block tables and sample rows
live in buffers sized from the scheduler's limits (`max_num_batched_tokens`
tokens, `max_num_seqs` sequences, `max_model_len` tokens of context), so
filling them allocates no tensor storage. The integers arrive as Python tuples
(the step crossed a pipe as plain records); `struct.pack_into` writes each
tuple straight into the memory the tensors share, one C call per sequence.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from kvwire.engine.paged_attention import AttentionMetadata, DecodeBatch, SequenceSlice
from kvwire.engine.step import ScheduledChunk

_INT64 = 8


class _Int64Buffer:
    """A zeroed int64 tensor whose memory Python can write without a temporary tensor."""

    def __init__(self, length: int) -> None:
        self.memory = bytearray(length * _INT64)
        self.tensor = torch.frombuffer(self.memory, dtype=torch.int64)

    def write(self, offset: int, values: Sequence[int]) -> None:
        struct.pack_into(f"{len(values)}q", self.memory, offset * _INT64, *values)


class StepBatch:
    """Preallocated tensors for one step's batch, refilled every step.

    Each KV cache group has its own block tables and slot mapping (its
    blocks are its own); positions, token ids and sample rows are shared.
    The `AttentionMetadata` (one per group) that `fill` returns
    views these buffers, so it is valid until the next `fill` (the
    connector sees it only during the step, as in vLLM).
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_groups: int = 1,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_groups = num_groups
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self._token_ids = _Int64Buffer(max_num_tokens)
        self._sample_rows = _Int64Buffer(max_num_seqs)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64)
        # Per token: where its sequence's block table starts in the flat tables.
        self._table_offsets = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._table_index = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._offsets_in_block = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._groups = [
            _GroupBuffers(max_num_tokens, max_num_seqs, self.max_blocks_per_seq)
            for _ in range(num_groups)
        ]
        # Single-token sequences, batched: rows and context lengths (the
        # block tables, as wide as the longest of them, are per group).
        self._decode_rows = _Int64Buffer(max_num_seqs)
        self._decode_context_lens = _Int64Buffer(max_num_seqs)

    def fill(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[tuple[AttentionMetadata, ...], torch.Tensor, torch.Tensor]:
        """Lay `chunks` into the buffers; the attention metadata (one per group),
        token ids and sample rows."""
        self._check_fits(chunks)
        block_size, width = self.block_size, self.max_blocks_per_seq
        decode_width = max(
            (-(-(c.start_position + 1) // block_size) for c in chunks if len(c.token_ids) == 1),
            default=0,
        )
        sequences: list[list[SequenceSlice]] = [[] for _ in self._groups]
        num_tokens = num_samples = num_decodes = 0
        for index, chunk in enumerate(chunks):
            count = len(chunk.token_ids)
            context_len = chunk.start_position + count
            num_context_blocks = -(-context_len // block_size)
            rows = slice(num_tokens, num_tokens + count)
            self._token_ids.write(num_tokens, chunk.token_ids)
            torch.arange(chunk.start_position, context_len, out=self.positions[rows])
            self._table_offsets[rows].fill_(index * width)
            for group, (buffers, block_ids) in enumerate(
                zip(self._groups, chunk.block_ids, strict=True)
            ):
                context_blocks = block_ids[:num_context_blocks]
                buffers.block_tables.write(index * width, context_blocks)
                if count == 1:
                    buffers.decode_tables.write(num_decodes * decode_width, context_blocks)
                else:
                    block_table = buffers.block_table_rows[index, :num_context_blocks]
                    sequences[group].append(
                        SequenceSlice(num_tokens, count, context_len, block_table)
                    )
            if count == 1:
                self._decode_rows.write(num_decodes, (num_tokens,))
                self._decode_context_lens.write(num_decodes, (context_len,))
                num_decodes += 1
            num_tokens += count
            if chunk.sample:
                self._sample_rows.write(num_samples, (num_tokens - 1,))
                num_samples += 1
        self._map_slots(num_tokens)
        metadata = tuple(
            AttentionMetadata(
                slot_mapping=buffers.slot_mapping[:num_tokens],
                positions=self.positions[:num_tokens],
                sequences=tuple(group_sequences),
                decodes=self._decode_batch(buffers, num_decodes, decode_width),
            )
            for buffers, group_sequences in zip(self._groups, sequences, strict=True)
        )
        sample_rows = self._sample_rows.tensor[:num_samples]
        return metadata, self._token_ids.tensor[:num_tokens], sample_rows

    def _decode_batch(
        self, buffers: _GroupBuffers, num_decodes: int, decode_width: int
    ) -> DecodeBatch | None:
        if not num_decodes:
            return None
        tables = buffers.decode_tables.tensor[: num_decodes * decode_width]
        return DecodeBatch(
            rows=self._decode_rows.tensor[:num_decodes],
            context_lens=self._decode_context_lens.tensor[:num_decodes],
            block_tables=tables.view(num_decodes, decode_width),
        )

    def _map_slots(self, num_tokens: int) -> None:
        # slot = block_tables[sequence, position // block_size] * block_size
        #        + position % block_size, for every token at once, per group.
        positions = self.positions[:num_tokens]
        table_index = self._table_index[:num_tokens]
        offsets = self._offsets_in_block[:num_tokens]
        torch.div(positions, self.block_size, rounding_mode="floor", out=table_index)
        table_index.add_(self._table_offsets[:num_tokens])
        torch.remainder(positions, self.block_size, out=offsets)
        for buffers in self._groups:
            slots = buffers.slot_mapping[:num_tokens]
            torch.index_select(buffers.block_tables.tensor, 0, table_index, out=slots)
            slots.mul_(self.block_size)
            slots.add_(offsets)

    def _check_fits(self, chunks: Sequence[ScheduledChunk]) -> None:
        width = self.max_blocks_per_seq
        for chunk in chunks:
            context_len = chunk.start_position + len(chunk.token_ids)
            if -(-context_len // self.block_size) > width:
                raise ValueError(
                    f"request {chunk.request_id!r}: a context of {context_len} tokens exceeds "
                    f"the worker's block tables ({width} blocks of {self.block_size} tokens)"
                )
        for chunk in chunks:
            if len(chunk.block_ids) != self.num_groups:
                raise ValueError(
                    f"request {chunk.request_id!r}: block ids for {len(chunk.block_ids)} KV "
                    f"cache groups, but the worker's cache has {self.num_groups}"
                )
        num_tokens = sum(len(chunk.token_ids) for chunk in chunks)
        if len(chunks) > self.max_num_seqs or num_tokens > self.max_num_tokens:
            raise ValueError(
                f"a step of {len(chunks)} sequences and {num_tokens} tokens exceeds the "
                f"worker's buffers (scheduler_config.max_num_seqs={self.max_num_seqs}, "
                f"scheduler_config.max_num_batched_tokens={self.max_num_tokens})"
            )


class _GroupBuffers:
    """One KV cache group's block tables (prefill and decode) and slot mapping."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.block_tables = _Int64Buffer(max_num_seqs * max_blocks_per_seq)
        self.block_table_rows = self.block_tables.tensor.view(max_num_seqs, max_blocks_per_seq)
        # Padding past a decode row's context holds stale but valid block
        # ids, never read unmasked.
        self.decode_tables = _Int64Buffer(max_num_seqs * max_blocks_per_seq)
        self.slot_mapping = torch.zeros(max_num_tokens, dtype=torch.int64)
