"""Sliding-window attention over the paged cache equals a dense computation of the same window."""

from __future__ import annotations

import pytest
import torch

from kvwire.config import ModelConfig
from kvwire.engine.paged_attention import DecodeBatch, PagedAttention, SequenceSlice

BLOCK_SIZE = 4
NUM_BLOCKS = 24
CONFIG = ModelConfig(num_layers=1, num_attention_heads=4, num_kv_heads=2, head_size=8)


def _dense(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: range, window: int
) -> torch.Tensor:
    """Each query row against the keys of its window, by the textbook formula."""
    group = CONFIG.num_attention_heads // CONFIG.num_kv_heads
    rows = []
    for row, position in enumerate(positions):
        lowest = max(0, position - window + 1)
        heads = []
        for head in range(CONFIG.num_attention_heads):
            kv_head = head // group
            k = keys[lowest : position + 1, kv_head].double()
            v = values[lowest : position + 1, kv_head].double()
            scores = (k @ query[row, head]) * CONFIG.head_size**-0.5
            heads.append(torch.softmax(scores, dim=0) @ v)
        rows.append(torch.cat(heads))
    return torch.stack(rows)


def _paged(context_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding random keys and values of ``context_len`` tokens in shuffled blocks."""
    cache = torch.randn(
        2, NUM_BLOCKS, BLOCK_SIZE, CONFIG.num_kv_heads, CONFIG.head_size, generator=generator
    )
    # Block 0 left out: a test may make it the null block.
    table = torch.randperm(NUM_BLOCKS - 1, generator=generator)[: -(-context_len // BLOCK_SIZE)] + 1
    return cache, table


def _dense_context(
    cache: torch.Tensor, table: torch.Tensor, length: int
) -> tuple[torch.Tensor, ...]:
    keys = cache[0, table].flatten(0, 1)[:length]
    values = cache[1, table].flatten(0, 1)[:length]
    return keys, values


@pytest.mark.parametrize(("window", "first", "context_len"), [(5, 10, 23), (8, 0, 17), (3, 20, 22)])
def test_a_prefill_chunk_sees_only_its_window(window: int, first: int, context_len: int) -> None:
    generator = torch.Generator().manual_seed(window)
    cache, table = _paged(context_len, generator)
    num_queries = context_len - first
    query = torch.randn(
        num_queries, CONFIG.num_attention_heads, CONFIG.head_size, generator=generator
    ).double()
    attention = PagedAttention(CONFIG, 64, BLOCK_SIZE, cache.dtype)
    output = torch.zeros(num_queries, CONFIG.hidden_size, dtype=torch.float64)
    sequence = SequenceSlice(0, num_queries, context_len, table)
    attention.attend(query, cache, sequence, output, window)

    keys, values = _dense_context(cache, table, context_len)
    expected = _dense(query, keys, values, range(first, context_len), window)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12)


def test_blocks_before_the_window_are_never_read() -> None:
    generator = torch.Generator().manual_seed(1)
    cache, table = _paged(24, generator)
    # What a sliding-window group holds there: the null block, here poisoned.
    cache[:, 0] = float("nan")
    table[:3] = 0
    query = torch.randn(2, CONFIG.num_attention_heads, CONFIG.head_size, generator=generator)
    attention = PagedAttention(CONFIG, 64, BLOCK_SIZE, cache.dtype)
    output = torch.zeros(2, CONFIG.hidden_size, dtype=torch.float64)
    attention.attend(query.double(), cache, SequenceSlice(0, 2, 24, table), output, 8)
    assert not output.isnan().any()


def test_a_decode_batch_sees_only_each_rows_window() -> None:
    generator = torch.Generator().manual_seed(7)
    cache = torch.randn(
        2, NUM_BLOCKS, BLOCK_SIZE, CONFIG.num_kv_heads, CONFIG.head_size, generator=generator
    )
    lengths = [21, 6, 13]
    tables = torch.randperm(NUM_BLOCKS, generator=generator)[:18].view(3, 6)
    window = 7
    query = torch.randn(3, CONFIG.num_attention_heads, CONFIG.head_size, generator=generator)
    query = query.double()
    decodes = DecodeBatch(
        rows=torch.arange(3), context_lens=torch.tensor(lengths), block_tables=tables
    )
    attention = PagedAttention(CONFIG, 64, BLOCK_SIZE, cache.dtype)
    output = torch.zeros(3, CONFIG.hidden_size, dtype=torch.float64)
    attention.attend_decodes(query, cache, decodes, output, window)

    for row, length in enumerate(lengths):
        keys, values = _dense_context(cache, tables[row], length)
        expected = _dense(query[row : row + 1], keys, values, range(length - 1, length), window)
        torch.testing.assert_close(output[row : row + 1], expected, rtol=1e-12, atol=1e-12)


def _poisoned(cache: torch.Tensor, slots: list[tuple[int, int]]) -> torch.Tensor:
    """A copy of ``cache`` with NaN keys and values in ``slots`` (block, offset)."""
    poisoned = cache.clone()
    for block, offset in slots:
        poisoned[:, block, offset] = float("nan")
    return poisoned


def test_a_prefill_chunk_ignores_what_the_cache_holds_outside_its_window() -> None:
    window = 5
    generator = torch.Generator().manual_seed(3)
    context_len, first = 22, 13  # queries 13..21; a window of 5 starts at 9, mid-block
    cache, table = _paged(context_len, generator)
    # Past the context (the last block's unused slots), and before the window.
    slots = [(int(table[-1]), offset) for offset in range(context_len % BLOCK_SIZE, BLOCK_SIZE)]
    slots += [(int(table[2]), 0)]  # position 8: before every query's window
    num_queries = context_len - first
    query = torch.randn(
        num_queries, CONFIG.num_attention_heads, CONFIG.head_size, generator=generator
    ).double()
    attention = PagedAttention(CONFIG, 64, BLOCK_SIZE, cache.dtype)
    outputs = []
    for contents in (cache, _poisoned(cache, slots)):
        output = torch.zeros(num_queries, CONFIG.hidden_size, dtype=torch.float64)
        sequence = SequenceSlice(0, num_queries, context_len, table)
        attention.attend(query, contents, sequence, output, window)
        outputs.append(output)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


@pytest.mark.parametrize("window", [None, 7])
def test_a_decode_batch_ignores_what_the_cache_holds_outside_each_rows_context(
    window: int | None,
) -> None:
    generator = torch.Generator().manual_seed(11)
    cache = torch.randn(
        2, NUM_BLOCKS, BLOCK_SIZE, CONFIG.num_kv_heads, CONFIG.head_size, generator=generator
    )
    lengths = [21, 6, 13]
    tables = torch.randperm(NUM_BLOCKS, generator=generator)[:18].view(3, 6)
    # Each row's slots past its context: the rest of its last block and its padding blocks.
    slots = [
        (int(tables[row, position // BLOCK_SIZE]), position % BLOCK_SIZE)
        for row, length in enumerate(lengths)
        for position in range(length, 6 * BLOCK_SIZE)
    ]
    if window is not None:
        slots += [(int(tables[0, 3]), 1)]  # row 0's position 13: before its window (14..20)
    query = torch.randn(3, CONFIG.num_attention_heads, CONFIG.head_size, generator=generator)
    decodes = DecodeBatch(
        rows=torch.arange(3), context_lens=torch.tensor(lengths), block_tables=tables
    )
    attention = PagedAttention(CONFIG, 64, BLOCK_SIZE, cache.dtype)
    outputs = []
    for contents in (cache, _poisoned(cache, slots)):
        output = torch.zeros(3, CONFIG.hidden_size, dtype=torch.float64)
        attention.attend_decodes(query.double(), contents, decodes, output, window)
        outputs.append(output)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
