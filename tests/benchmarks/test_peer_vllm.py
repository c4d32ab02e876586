"""The vLLM half of the peer benchmark's table: each configuration's TTFT against computing the
prompts, the peer medium's against NixlConnector's, and tokens checked against no connector's."""

from __future__ import annotations

from typing import Any

import pytest
from benchmarks.peer_vllm import summarize


def measured(seconds: list[float], tokens: list[list[int]], **by_source: float) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "tokens": tokens,
        "prompt_tokens_by_source": by_source,
        "kvwire_stats": {},
    }


def test_each_ttft_is_a_ratio_of_the_no_connector_p50_and_peer_is_compared_with_nixl() -> None:
    table = summarize(
        {
            "no connector": measured([1.0, 3.0, 2.0], [[5], [6], [7]], local_compute=300),
            "vLLM NixlConnector": measured([0.2, 0.2, 0.4], [[5], [6], [7]]),
            "kvwire peer": measured([0.3, 0.3, 0.1], [[5], [6], [8]], local_compute=96),
        },
        3,
        100,
        {},
    )
    entries = table["configurations"]
    assert entries["no connector"]["ttft_over_no_connector"] == 1.0
    assert entries["vLLM NixlConnector"]["ttft_over_no_connector"] == pytest.approx(0.1)
    assert entries["kvwire peer"]["ttft_over_no_connector"] == pytest.approx(0.15)
    assert table["peer_ttft_over_nixl"] == pytest.approx(1.5)
    assert entries["vLLM NixlConnector"]["tokens_equal_no_connector"]
    assert not entries["kvwire peer"]["tokens_equal_no_connector"]
    assert entries["kvwire peer"]["prompt_tokens_computed"] == 96
