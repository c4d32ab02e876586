"""Asynchronous loads that fail, in a real vLLM engine: every request still finishes, once.

vLLM frees a request whose asynchronous load failed at its first loaded
block and looks it up again (``get_num_new_matched_tokens``) as if new. A
connector that offered the same blocks again would fail the same way (a
load slower than its deadline) or, with a KV cache too small for every
waiting load, hold vLLM's admission loop at a request it cannot admit. Each
engine here is stepped with a deadline, so an engine that stops finishing
requests fails the test instead of hanging it.
"""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

import pytest

import kvwire.vllm
from tests.support.vllm import (
    counters,
    counting_recoveries,
    generate_within,
    kvwire_transfer_config,
    load_profile_mapping,
    profile_with_directory,
    running_llm,
    shared_prompts,
    with_redis_url,
)

# Generous for 3-8 tiny requests on a loaded 2-core host (a pass takes 1-3 s);
# the failures this guards against never finish.
PASS_LIMIT_S = 90.0


def redis_async_profile(redis_url: str, **extra: Any) -> dict[str, Any]:
    """The Redis profile with asynchronous loads, and ``extra`` in its extra config."""
    key_prefix = f"kvwire:test-failed-async-{uuid.uuid4().hex[:8]}:"
    profile = with_redis_url(load_profile_mapping("redis.yaml"), redis_url, key_prefix)
    profile["kv_transfer_config"]["kv_connector_extra_config"].update(async_load=True, **extra)
    return profile


def cold_pass(llm: Any, prompts: list[dict[str, list[int]]]) -> list[list[int]]:
    """Generate with nothing to load, settle the saves, empty vLLM's prefix cache."""
    cold, _ = generate_within(llm, prompts, PASS_LIMIT_S)
    kvwire.vllm.wait_for_saves(llm)
    assert llm.reset_prefix_cache()
    return cold


def counter(llm: Any, name: str) -> int:
    """kvwire's counter ``name`` (``loads_failed``: requests' loads that failed, once per try)."""
    stats = kvwire.vllm.kvwire_stats(llm)
    return int(sum(counters(stats, name)))


# ---------------------------------------------------------- loads past their deadline


@pytest.mark.slow
def test_asynchronous_loads_past_their_deadline_are_computed_once_then_withheld(
    tiny_model: str, redis_url: str, tokens_without_connector: list[list[int]]
) -> None:
    # A healthy Redis whose every load takes longer than its 1 µs deadline;
    # three failed loads in a row withhold its hits for a minute.
    profile = redis_async_profile(
        redis_url, load_timeout_s=1e-6, load_failures_to_pause=3, load_pause_s=60
    )
    prompts = shared_prompts()
    with running_llm(tiny_model, kvwire_transfer_config(profile)) as llm:
        cold = cold_pass(llm, prompts)
        with counting_recoveries() as recoveries:
            warm, cached = generate_within(llm, prompts, PASS_LIMIT_S)
        failed = counter(llm, "loads_failed")
        kvwire.vllm.wait_for_saves(llm)
        assert llm.reset_prefix_cache()
        withheld, withheld_cached = generate_within(llm, prompts, PASS_LIMIT_S)
        stats = {name: counter(llm, name) for name in ("loads_failed", "load_pauses")}
        paused_lookups = counter(llm, "lookups_paused")
    assert cold == warm == withheld == tokens_without_connector
    assert cached == withheld_cached == [0] * len(prompts)
    # Each request's load failed once: it was never offered again.
    assert failed == len(prompts)
    assert recoveries.count <= len(prompts)
    # The next pass found the hits withheld: no load was tried.
    assert stats == {"loads_failed": len(prompts), "load_pauses": 1}
    assert paused_lookups >= len(prompts)


# ------------------------------------------------------------ a small KV cache


# What each request's failed load leaves in its first block (0xFF bytes: NaN) is
# zeroed before vLLM hears of the failure: vLLM frees and reuses those blocks,
# as other requests' partly filled last blocks too, within the pass.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("medium", "warm_passes"),
    [
        ("tests.support.media:FailEveryFirstBlock", 1),
        # Loads end in any order, each read 0-80 ms late: several passes.
        ("tests.support.vllm:FailEveryFirstBlockOfDelayedLoads", 4),
    ],
    ids=["loads", "delayed-loads"],
)
def test_failed_asynchronous_loads_in_a_small_kv_cache_are_computed_and_every_request_finishes(
    medium: str,
    warm_passes: int,
    tiny_model: str,
    tokens_without_connector: list[list[int]],
    tmp_path: pathlib.Path,
) -> None:
    # 70 KV cache blocks, 8 requests of 10 blocks each: not every waiting
    # load fits at once. Every request's first load fails at its first block.
    profile = profile_with_directory("shared-storage.yaml", tmp_path)
    extra = profile["kv_transfer_config"]["kv_connector_extra_config"]
    # Hits never withheld: each request's failed load alone must not be offered again.
    extra.update(async_load=True, medium=medium, load_failures_to_pause=1000)
    prompts = shared_prompts(count=8)
    small_cache = {"num_gpu_blocks_override": 70, "max_model_len": 512}
    with running_llm(tiny_model, kvwire_transfer_config(profile), **small_cache) as llm:
        cold = cold_pass(llm, prompts)
        warm = []
        with counting_recoveries() as recoveries:
            for _ in range(warm_passes):
                # vLLM names each pass's requests anew: each one's first load fails.
                tokens, _ = generate_within(llm, prompts, PASS_LIMIT_S)
                warm.append(tokens)
                kvwire.vllm.wait_for_saves(llm)
                assert llm.reset_prefix_cache()
        failed = counter(llm, "loads_failed")
        scrubbed = counter(llm, "load_blocks_scrubbed")
    assert cold[:3] == tokens_without_connector
    assert warm == [cold] * warm_passes
    assert failed == len(prompts) * warm_passes
    assert scrubbed >= failed
    assert recoveries.count <= failed


# ------------------------------------------------------------------ hybrid model


@pytest.mark.slow
def test_no_tier_offers_a_failed_load_again_in_a_small_kv_cache_on_a_hybrid_model(
    tiny_hybrid_model: str, redis_url: str, tmp_path: pathlib.Path
) -> None:
    # vLLM recomputes a failed asynchronous load of a hybrid model from its
    # first token and looks the request up again: the sliding-window groups'
    # path. kvwire's MultiConnector: Redis first (every load past its
    # deadline, hits never withheld), then a directory holding every block.
    # An asynchronous load the directory offered the request looked up again
    # would stall vLLM's admission in this 70-block cache: no tier offers it.
    redis = redis_async_profile(redis_url, load_timeout_s=1e-6, load_failures_to_pause=1000)
    directory = profile_with_directory("shared-storage.yaml", tmp_path)["kv_transfer_config"]
    directory["kv_connector_extra_config"]["async_load"] = True
    tiers = {
        "kv_transfer_config": {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [redis["kv_transfer_config"], directory]},
        }
    }
    prompts = shared_prompts(count=8)
    small_cache = {"num_gpu_blocks_override": 70, "max_model_len": 512}
    with running_llm(tiny_hybrid_model, kvwire_transfer_config(tiers), **small_cache) as llm:
        cold = cold_pass(llm, prompts)
        warm, cached = generate_within(llm, prompts, PASS_LIMIT_S)
        stats = kvwire.vllm.kvwire_stats(llm)
    assert warm == cold
    assert cached == [0] * len(prompts)
    failed = {key: value for key, value in stats.items() if key.endswith(".loads_failed")}
    assert failed == {"RedisConnector.loads_failed": len(prompts)}, stats
