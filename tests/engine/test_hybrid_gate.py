"""The HMA gate decides the engine's cache layout on a hybrid model, and connectors see groups."""

from __future__ import annotations

import logging

import attrs
import pytest

from kvwire.engine.block_manager import NULL_BLOCK
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.hma import HMADecision, describe_kv_cache_groups
from kvwire.run.passes import compare_passes
from kvwire.run.report import format_table
from tests.support.engines import (
    PlainConnector,
    RecordingHMAConnector,
    tiny_hybrid_config,
    with_connector_class,
)

PROMPT = tuple(range(1, 41))  # ten blocks; the window (8 tokens) is two


def test_a_connector_without_hma_turns_it_off_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvwire")
    with LLMEngine(with_connector_class(tiny_hybrid_config(), PlainConnector)) as engine:
        assert not engine.hma_enabled
        assert len(engine.kv_cache_config.kv_cache_groups) == 1
        assert "PlainConnector does not support HMA: HMA is turned off" in engine.hma.reason
        engine.generate([GenerationRequest("r", PROMPT, 2)])
    assert "PlainConnector does not support HMA: HMA is turned off" in caplog.text


def test_an_explicit_false_with_a_connector_without_hma_is_the_seeds_error() -> None:
    config = with_connector_class(
        tiny_hybrid_config(disable_hybrid_kv_cache_manager=False), PlainConnector
    )
    with pytest.raises(
        ValueError,
        match=r"Connector PlainConnector does not support HMA but HMA is enabled\. "
        r"Please set `--disable-hybrid-kv-cache-manager`\.",
    ):
        LLMEngine(config)


def test_an_hma_connector_keeps_it_on_and_gets_block_ids_per_group() -> None:
    with LLMEngine(with_connector_class(tiny_hybrid_config(), RecordingHMAConnector)) as engine:
        assert engine.hma_enabled and len(engine.kv_cache_config.kv_cache_groups) == 2
        engine.generate([GenerationRequest("r", PROMPT, 3)])
        connector = engine.scheduler_connector
    assert isinstance(connector, RecordingHMAConnector)

    [(request_id, allocated)] = connector.allocated
    assert request_id == "r" and len(allocated) == 2
    full, sliding = allocated
    assert len(full) == len(sliding) == 10 and NULL_BLOCK not in full + sliding
    assert not set(full) & set(sliding)  # one pool: ids unique across groups

    assert all(len(block_ids) == 2 for _request, block_ids in connector.scheduled)
    # Decode steps: the sliding group's blocks that left the window became null.
    _request, last_scheduled = connector.scheduled[-1]
    assert last_scheduled[0][:8] == full[:8] and last_scheduled[1][:8] == [NULL_BLOCK] * 8

    [(request_id, finished)] = connector.finished
    assert request_id == "r" and finished == last_scheduled


def test_hma_disabled_gives_an_hma_connector_one_group() -> None:
    config = with_connector_class(
        tiny_hybrid_config(disable_hybrid_kv_cache_manager=True), RecordingHMAConnector
    )
    with LLMEngine(config) as engine:
        assert not engine.hma_enabled
        engine.generate([GenerationRequest("r", PROMPT, 2)])
        connector = engine.scheduler_connector
    assert isinstance(connector, RecordingHMAConnector)
    [(_request, finished)] = connector.finished
    assert len(finished) == 1 and len(finished[0]) == 11


def test_kvwire_runs_report_says_whether_hma_was_on_and_why() -> None:
    config = with_connector_class(tiny_hybrid_config(), RecordingHMAConnector)
    report = compare_passes(config, [GenerationRequest("r", PROMPT, 2)])
    assert report["ok"]
    assert report["hma"] == {
        "enabled": True,
        "reason": "disable_hybrid_kv_cache_manager is unset and RecordingHMAConnector "
        "supports HMA: HMA stays on",
        "kv_cache_groups": 2,
    }
    assert "\nHMA on: disable_hybrid_kv_cache_manager is unset" in format_table(report)
    assert "2 KV cache groups" in format_table(report)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_check_describes_an_all_sliding_models_groups_by_their_specs(enabled: bool) -> None:
    config = tiny_hybrid_config()
    model = attrs.evolve(config.model_config, layer_types=("sliding_attention",) * 4)
    decision = HMADecision(enabled=enabled, reason="test")
    described = describe_kv_cache_groups(attrs.evolve(config, model_config=model), decision)
    if enabled:
        # One group, and it is a sliding-window one: HMA is on.
        assert described.startswith(
            "KV cache groups: 1 with HMA on (group 0: sliding window 8, layers.0.attn, "
        )
    else:
        assert described.startswith("KV cache groups: 1 with HMA off (")
