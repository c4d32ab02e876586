"""KVWireConnector in a vLLM engine: outputs as without it, and a warm pass served by kvwire."""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

import pytest

import kvwire.vllm
from tests.support.vllm import (
    BLOCK_SIZE,
    counters,
    generate,
    kvwire_transfer_config,
    load_profile_mapping,
    profile_with_directory,
    running_llm,
    shared_prompts,
    with_redis_url,
)

PROMPTS = shared_prompts()
EVERY_KV_BOTH_PROFILE = [
    "cpu-offload.yaml",
    "shared-storage.yaml",
    "tiered-disk.yaml",
    "redis.yaml",
    "tiered-redis.yaml",
]
LOADABLE_TOKENS = (300 - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt token is always computed


def cold_then_warm(llm: Any) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Generate, settle the saves, empty vLLM's prefix cache, generate again."""
    cold, _ = generate(llm, PROMPTS)
    kvwire.vllm.wait_for_saves(llm)
    assert llm.reset_prefix_cache()
    warm, cached = generate(llm, PROMPTS)
    return cold, warm, cached


@pytest.mark.slow
@pytest.mark.parametrize(
    ("profile", "options"),
    [
        *((profile, {}) for profile in EVERY_KV_BOTH_PROFILE),
        # A lookup that answers None first, then the count from its thread.
        ("redis.yaml", {"async_lookup": True, "lookup_deadline_s": 60}),
    ],
    ids=[*EVERY_KV_BOTH_PROFILE, "redis.yaml-async-lookup"],
)
def test_outputs_equal_no_connector_and_warm_pass_loads_from_kvwire(
    profile: str,
    options: dict[str, Any],
    tiny_model: str,
    tokens_without_connector: list[list[int]],
    tmp_path: pathlib.Path,
    request: pytest.FixtureRequest,
) -> None:
    mapping = profile_with_directory(profile, tmp_path)
    mapping["kv_transfer_config"]["kv_connector_extra_config"].update(options)
    if "redis" in profile:
        key_prefix = f"kvwire:test-{uuid.uuid4().hex[:8]}:"
        mapping = with_redis_url(mapping, request.getfixturevalue("redis_url"), key_prefix)
    with running_llm(tiny_model, kvwire_transfer_config(mapping)) as llm:
        cold, warm, cached = cold_then_warm(llm)
        stats = kvwire.vllm.kvwire_stats(llm)
    assert cold == tokens_without_connector
    assert warm == tokens_without_connector
    assert cached == [LOADABLE_TOKENS] * len(PROMPTS)
    loaded = sum(counters(stats, "blocks_loaded"))
    assert loaded == len(PROMPTS) * LOADABLE_TOKENS // BLOCK_SIZE
    assert not any(counters(stats, "load_errors", tiers=True))
    started = sum(counters(stats, "lookups_started", tiers=True))
    assert (started > 0) == bool(options.get("async_lookup"))


EVERY_BLOCK_INTO_THE_POOL = {"save_threshold": 1, "write_around": False}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "why"),
    [
        # The profile as shipped: a block saved once is written around the pool.
        ({}, "written_around_blocks"),
        ({**EVERY_BLOCK_INTO_THE_POOL, "write_policy": "spill"}, "spilled_blocks"),
        ({**EVERY_BLOCK_INTO_THE_POOL, "write_policy": "write_through"}, "written_through_blocks"),
    ],
    ids=["tiered-disk.yaml", "spill", "write_through"],
)
def test_a_tiered_pool_too_small_for_the_prompts_brings_them_back_from_its_tier(
    options: dict[str, Any],
    why: str,
    tiny_model: str,
    tokens_without_connector: list[list[int]],
    tmp_path: pathlib.Path,
) -> None:
    mapping = profile_with_directory("tiered-disk.yaml", tmp_path)
    extra = mapping["kv_transfer_config"]["kv_connector_extra_config"]
    # 12 slots of 32 KiB: one prompt's 9 blocks fit, the next one's evict them.
    extra.update(cpu_pool_bytes="400KiB", **options)
    passes: list[list[list[int]]] = [[], []]
    with running_llm(tiny_model, kvwire_transfer_config(mapping)) as llm:
        for outputs in passes:
            for prompt in PROMPTS:
                tokens, _ = generate(llm, [prompt])
                kvwire.vllm.wait_for_saves(llm)
                assert llm.reset_prefix_cache()
                outputs += tokens
        stats = kvwire.vllm.kvwire_stats(llm)
    assert passes == [tokens_without_connector, tokens_without_connector]
    assert stats["evicted_blocks"] > 0
    assert stats[f"tier1.{why}"] > 0
    assert stats["tier1.promoted_blocks"] == stats["tier1.blocks_loaded"] > 0
    assert not any(counters(stats, "load_errors", tiers=True))


@pytest.mark.slow
def test_outputs_equal_no_connector_when_vllm_preempts_a_request(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 17 blocks: two 250-token requests fit, then both need a ninth block while decoding.
    small_cache = {"num_gpu_blocks_override": 17, "max_model_len": 512}
    prompts = shared_prompts(count=3, length=250)
    with running_llm(tiny_model, **small_cache) as llm:
        expected, _ = generate(llm, prompts, max_tokens=40)
    config = kvwire_transfer_config(load_profile_mapping("cpu-offload.yaml"))
    with running_llm(tiny_model, config, **small_cache) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        preempted: list[str] = []
        preempt = scheduler._preempt_request

        def recording_preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
            preempted.append(request.request_id)
            return preempt(request, *args, **kwargs)

        monkeypatch.setattr(scheduler, "_preempt_request", recording_preempt)
        tokens, _ = generate(llm, prompts, max_tokens=40)
    assert preempted
    assert tokens == expected
