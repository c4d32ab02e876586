"""Disaggregated prefill across two vLLM processes: a producer engine saves, a consumer engine
(this test's process) loads and continues; its tokens equal one engine doing both."""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

import pytest

import kvwire.vllm
from tests.support.vllm import (
    BLOCK_SIZE,
    MAX_TOKENS,
    generate,
    kvwire_transfer_config,
    load_profile_mapping,
    profile_with_directory,
    run_engine_process,
    running_llm,
    shared_prompts,
    with_redis_url,
)

PROMPTS = shared_prompts()
LOADABLE_BLOCKS = (300 - 1) // BLOCK_SIZE


def prefill_elsewhere_then_decode_here(
    model: str, producer_profile: dict[str, Any], consumer_profile: dict[str, Any], workdir: Any
) -> tuple[list[list[int]], list[int], dict[str, Any], dict[str, Any]]:
    produced = run_engine_process(
        model, kvwire_transfer_config(producer_profile, "kv_producer"), PROMPTS, 1, workdir
    )
    with running_llm(model, kvwire_transfer_config(consumer_profile, "kv_consumer")) as llm:
        tokens, cached = generate(llm, PROMPTS)
        consumer_stats = kvwire.vllm.kvwire_stats(llm)
    return tokens, cached, produced, consumer_stats


def with_role(profile: dict[str, Any], kv_role: str) -> dict[str, Any]:
    profile["kv_transfer_config"]["kv_role"] = kv_role
    return profile


@pytest.mark.slow
def test_consumer_continues_from_shared_storage_a_producer_process_filled(
    tiny_model: str, tokens_without_connector: list[list[int]], tmp_path: pathlib.Path
) -> None:
    producer = with_role(profile_with_directory("shared-storage.yaml", tmp_path), "kv_producer")
    consumer = with_role(profile_with_directory("shared-storage.yaml", tmp_path), "kv_consumer")
    tokens, cached, produced, consumed = prefill_elsewhere_then_decode_here(
        tiny_model, producer, consumer, tmp_path
    )
    assert produced["stats"]["blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert consumed["blocks_loaded"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
    assert tokens == tokens_without_connector
    assert all(len(sequence) == MAX_TOKENS for sequence in tokens)


@pytest.mark.slow
def test_consumer_continues_from_redis_a_producer_process_filled(
    tiny_model: str,
    tokens_without_connector: list[list[int]],
    redis_url: str,
    tmp_path: pathlib.Path,
) -> None:
    # The shipped disaggregated profiles: the decode side loads asynchronously.
    key_prefix = f"kvwire:test-{uuid.uuid4().hex[:8]}:"
    producer = with_redis_url(load_profile_mapping("disagg-prefill.yaml"), redis_url, key_prefix)
    consumer = with_redis_url(load_profile_mapping("disagg-decode.yaml"), redis_url, key_prefix)
    tokens, cached, produced, consumed = prefill_elsewhere_then_decode_here(
        tiny_model, producer, consumer, tmp_path
    )
    assert produced["stats"]["blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert consumed["blocks_loaded"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
    assert tokens == tokens_without_connector
