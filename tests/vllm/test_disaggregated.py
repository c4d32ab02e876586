"""Disaggregated prefill across two vLLM processes: a producer engine saves, a consumer engine
(this test's process) loads and continues; its tokens equal one engine doing both.

One producer process serves both consumers: a MultiConnector of the shared
storage and the shipped Redis prefill profile saves every block to both.
"""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

import attrs
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


@attrs.frozen
class Produced:
    """Where the producer saved, and its stats."""

    workdir: pathlib.Path
    key_prefix: str
    stats: dict[str, Any]


def with_role(profile: dict[str, Any], kv_role: str) -> dict[str, Any]:
    profile["kv_transfer_config"]["kv_role"] = kv_role
    return profile


@pytest.fixture(scope="module")
def produced(tiny_model: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Produced:
    workdir = tmp_path_factory.mktemp("disaggregated")
    key_prefix = f"kvwire:test-{uuid.uuid4().hex[:8]}:"
    storage = with_role(profile_with_directory("shared-storage.yaml", workdir), "kv_producer")
    redis = with_redis_url(load_profile_mapping("disagg-prefill.yaml"), redis_url, key_prefix)
    producer = {
        "kv_transfer_config": {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_producer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "connectors": [storage["kv_transfer_config"], redis["kv_transfer_config"]]
            },
        }
    }
    result = run_engine_process(
        tiny_model, kvwire_transfer_config(producer, "kv_producer"), PROMPTS, 1, workdir
    )
    return Produced(workdir, key_prefix, result["stats"])


def decode_here(model: str, consumer_profile: dict[str, Any]) -> tuple[Any, Any, Any]:
    with running_llm(model, kvwire_transfer_config(consumer_profile, "kv_consumer")) as llm:
        tokens, cached = generate(llm, PROMPTS)
        consumer_stats = kvwire.vllm.kvwire_stats(llm)
    return tokens, cached, consumer_stats


@pytest.mark.slow
def test_consumer_continues_from_shared_storage_a_producer_process_filled(
    tiny_model: str, tokens_without_connector: list[list[int]], produced: Produced
) -> None:
    consumer = with_role(
        profile_with_directory("shared-storage.yaml", produced.workdir), "kv_consumer"
    )
    tokens, cached, consumed = decode_here(tiny_model, consumer)
    assert produced.stats["SharedStorageConnector.blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert consumed["blocks_loaded"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
    assert tokens == tokens_without_connector
    assert all(len(sequence) == MAX_TOKENS for sequence in tokens)


@pytest.mark.slow
def test_consumer_continues_from_redis_a_producer_process_filled(
    tiny_model: str,
    tokens_without_connector: list[list[int]],
    redis_url: str,
    produced: Produced,
) -> None:
    # The shipped disaggregated decode profile: it loads asynchronously.
    consumer = with_redis_url(
        load_profile_mapping("disagg-decode.yaml"), redis_url, produced.key_prefix
    )
    tokens, cached, consumed = decode_here(tiny_model, consumer)
    assert produced.stats["RedisConnector.blocks_saved"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert consumed["blocks_loaded"] == len(PROMPTS) * LOADABLE_BLOCKS
    assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
    assert tokens == tokens_without_connector
