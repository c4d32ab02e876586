"""The vLLM benchmark's tensor-parallel table: its ratios, and the token checks beside them.

The engines run only in the benchmark itself (``--only vllm``); these are its sums.
"""

from __future__ import annotations

from typing import Any

import pytest
from benchmarks.vllm import same_tokens, summarize_tensor_parallel

TOKENS = [[1, 2, 3], [4, 5, 6]]


def engine(warm: list[float], **passes: Any) -> dict[str, Any]:
    return {"warm_seconds": warm, "warm_tokens": TOKENS, "warm_cached": [256, 256], **passes}


def tensor_parallel_table(cross_size_tokens: list[list[int]]) -> dict[str, Any]:
    return summarize_tensor_parallel(
        tp1_no_connector=engine([0.50, 0.40, 0.90]),
        tp1=engine([0.020, 0.060, 0.010]),
        tp2_bound=engine([0.80, 0.70, 1.20]),
        tp2=engine(
            [0.040, 0.090, 0.050],
            stored_seconds=[0.060, 0.070, 0.200],
            stored_tokens=cross_size_tokens,
            stored_cached=[256, 128, 256],
            kvwire_stats={"blocks_loaded": 12, "load_errors": 0},
        ),
    )


def test_ratios_are_of_the_median_warm_times_of_the_same_run() -> None:
    table = tensor_parallel_table(TOKENS + TOKENS)

    assert table["warm_ttft_p50_s"] == {
        "TP=1 no connector": 0.50,
        "TP=1 kvwire, written and loaded at TP=1": 0.020,
        "TP=2 no connector": 0.80,
        "TP=2 kvwire, written and loaded at TP=2": 0.050,
        "TP=2 kvwire, written at TP=1, loaded at TP=2": 0.070,
    }
    assert table["tp2_warm_vs_tp2_no_connector"] == pytest.approx(0.050 / 0.80)
    assert table["tp2_warm_vs_tp1_warm"] == pytest.approx(0.050 / 0.020)
    assert table["tp2_no_connector_vs_tp1_no_connector"] == pytest.approx(0.80 / 0.50)
    assert table["cross_size_vs_same_size"] == pytest.approx(0.070 / 0.050)
    assert table["cross_size_vs_tp2_no_connector"] == pytest.approx(0.070 / 0.80)
    assert table["cached_tokens"]["TP=2 cross-size"] == [128, 256]
    # A counter the run did not report is 0, not missing.
    assert table["kvwire_stats_tp2"] == {"blocks_loaded": 12, "load_errors": 0, "saves_dropped": 0}


def test_a_cross_size_pass_with_other_tokens_is_reported_unequal() -> None:
    table = tensor_parallel_table([[1, 2, 3], [4, 5, 7]])

    assert table["tp2_warm_tokens_equal_tp2_no_connector"] is True
    assert table["tp1_warm_tokens_equal_tp1_no_connector"] is True
    assert table["cross_size_tokens_equal_tp1_no_connector"] is False


def test_tokens_are_compared_round_by_round_and_a_partial_round_is_unequal() -> None:
    assert same_tokens(TOKENS * 3, TOKENS)
    assert not same_tokens(TOKENS + TOKENS[:1], TOKENS)
    assert not same_tokens([TOKENS[1], TOKENS[0]], TOKENS)
