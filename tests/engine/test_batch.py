"""The worker lays each step into buffers allocated once, and refills them correctly."""

from __future__ import annotations

import pytest

from kvwire.engine.batch import StepBatch
from kvwire.engine.step import ScheduledChunk

BLOCK_SIZE = 4


def _batch() -> StepBatch:
    return StepBatch(max_num_tokens=16, max_num_seqs=3, max_model_len=32, block_size=BLOCK_SIZE)


def _prefill_and_decode() -> tuple[ScheduledChunk, ...]:
    return (
        # Positions 2..6 of a request in blocks 9 then 3.
        ScheduledChunk("a", (10, 11, 12, 13, 14), 2, ((9, 3, 5),), sample=True),
        # One decode token at position 8 of a request in blocks 7, 1, 4.
        ScheduledChunk("b", (20,), 8, ((7, 1, 4),), sample=True),
    )


def test_slots_positions_and_tokens_follow_each_sequences_block_table() -> None:
    (metadata,), token_ids, sample_rows = _batch().fill(_prefill_and_decode())

    assert token_ids.tolist() == [10, 11, 12, 13, 14, 20]
    assert metadata.positions.tolist() == [2, 3, 4, 5, 6, 8]
    assert metadata.slot_mapping.tolist() == [38, 39, 12, 13, 14, 16]
    assert sample_rows.tolist() == [4, 5]
    assert [s.block_table.tolist() for s in metadata.sequences] == [[9, 3]]
    assert [(s.query_start, s.num_query_tokens, s.context_len) for s in metadata.sequences] == [
        (0, 5, 7)
    ]


def test_single_token_sequences_form_one_decode_batch_padded_to_the_longest_context() -> None:
    chunks = (
        *_prefill_and_decode(),
        # Another decode, at position 2: one block of context.
        ScheduledChunk("c", (30,), 2, ((6,),), sample=True),
    )
    (metadata,), _tokens, _rows = _batch().fill(chunks)
    decodes = metadata.decodes
    assert decodes is not None
    assert decodes.rows.tolist() == [5, 6]
    assert decodes.context_lens.tolist() == [9, 3]
    assert decodes.block_tables.shape == (2, 3)
    assert decodes.block_tables[0].tolist() == [7, 1, 4]
    assert decodes.block_tables[1, 0].item() == 6


def test_a_step_without_single_token_sequences_has_no_decode_batch() -> None:
    (metadata,), _tokens, _rows = _batch().fill((_prefill_and_decode()[0],))
    assert metadata.decodes is None


def test_refilling_reuses_the_same_memory() -> None:
    batch = _batch()
    (first,), first_tokens, _ = batch.fill(_prefill_and_decode())
    (second,), second_tokens, _ = batch.fill(
        (ScheduledChunk("c", (1, 2), 0, ((6,),), sample=False),)
    )

    assert second.slot_mapping.data_ptr() == first.slot_mapping.data_ptr()
    assert second_tokens.data_ptr() == first_tokens.data_ptr()
    assert second.slot_mapping.tolist() == [24, 25]


def test_a_chunk_not_sampled_adds_no_sample_row() -> None:
    _metadata, _tokens, sample_rows = _batch().fill(
        (ScheduledChunk("c", (1, 2), 0, ((6,),), sample=False),)
    )
    assert sample_rows.numel() == 0


def test_a_step_larger_than_the_scheduler_limits_is_refused_naming_them() -> None:
    chunk = ScheduledChunk("a", tuple(range(17)), 0, (tuple(range(5)),), sample=True)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=16"):
        _batch().fill((chunk,))


def test_a_context_longer_than_the_block_tables_is_refused_naming_the_request() -> None:
    chunk = ScheduledChunk("long", (1,), 32, (tuple(range(9)),), sample=True)
    with pytest.raises(ValueError, match=r"request 'long': a context of 33 tokens exceeds"):
        _batch().fill((chunk,))
