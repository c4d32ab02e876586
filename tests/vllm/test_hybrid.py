"""KVWireConnector on a hybrid model (sliding-window and full-attention layers) with HMA on.

The tiny Gemma 3 has two KV cache groups in vLLM: a sliding-window group
(window 64 = 2 blocks of 32) and a full-attention one. kvwire saves every
full block of the full group, only the blocks near the end of a
sliding-window group's window, and never vLLM's null block (id 0). A warm pass runs
on a zeroed KV cache, so that its outputs equal the outputs without a
connector only if every block each group needs was loaded.
"""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

import pytest

import kvwire.vllm
from kvwire.exceptions import VLLMConfigError
from tests.support.media import name_another_block
from tests.support.vllm import (
    BLOCK_SIZE,
    MAX_TOKENS,
    SLIDING_WINDOW,
    GroupsConnector,
    PlainConnector,
    counters,
    generate,
    kvwire_transfer_config,
    load_profile_mapping,
    profile_with_directory,
    run_engine_process,
    running_llm,
    shared_prompts,
    start_llm,
    with_redis_url,
    wrapping_profile,
)
from tests.vllm.test_corruption import flip_one_payload_byte, rewrite_each_entry

PROMPTS = shared_prompts()
LOADABLE_BLOCKS = (300 - 1) // BLOCK_SIZE  # the last prompt token is always computed
WINDOW_BLOCKS = -(-(SLIDING_WINDOW - 1) // BLOCK_SIZE)  # the sliding group's blocks per hit
NULL_BLOCK_ID = 0
LAYER = "model.layers.{}.self_attn.attn".format


@pytest.fixture(scope="module")
def hybrid_tokens_without_connector(tiny_hybrid_model: str) -> list[list[int]]:
    with running_llm(tiny_hybrid_model) as llm:
        tokens, _ = generate(llm, PROMPTS)
    return tokens


def kv_caches(llm: Any) -> dict[str, Any]:
    """Each attention layer's KV cache tensor in vLLM's (in-process) worker."""
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    layers = worker.model_runner.compilation_config.static_forward_context
    return {name: layer.kv_cache for name, layer in layers.items()}


def zero_kv_caches(llm: Any) -> None:
    for cache in kv_caches(llm).values():
        cache.zero_()


def group_kinds(llm: Any) -> list[tuple[str, int | None, list[str]]]:
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [
        (
            type(group.kv_cache_spec).__name__,
            getattr(group.kv_cache_spec, "sliding_window", None),
            list(group.layer_names),
        )
        for group in config.kv_cache_groups
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "profile", ["cpu-offload.yaml", "shared-storage.yaml", "tiered-disk.yaml", "redis.yaml"]
)
def test_hybrid_model_with_hma_on_loads_each_group_s_needed_blocks_from_kvwire(
    profile: str,
    tiny_hybrid_model: str,
    hybrid_tokens_without_connector: list[list[int]],
    tmp_path: pathlib.Path,
    request: pytest.FixtureRequest,
) -> None:
    expected = hybrid_tokens_without_connector
    mapping = profile_with_directory(profile, tmp_path)
    if "redis" in profile:
        key_prefix = f"kvwire:test-hybrid-{uuid.uuid4().hex[:8]}:"
        mapping = with_redis_url(mapping, request.getfixturevalue("redis_url"), key_prefix)
    config = kvwire_transfer_config(mapping)
    with running_llm(tiny_hybrid_model, config) as llm:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert group_kinds(llm) == [
            ("SlidingWindowSpec", SLIDING_WINDOW, [LAYER(0), LAYER(2)]),
            ("FullAttentionSpec", None, [LAYER(1), LAYER(3)]),
        ]
        cold, _ = generate(llm, PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        # vLLM's own prefix cache on a zeroed KV cache: the zeros are read.
        zero_kv_caches(llm)
        from_zeros, _ = generate(llm, PROMPTS)
        assert llm.reset_prefix_cache()
        zero_kv_caches(llm)
        warm, cached = generate(llm, PROMPTS)
        null_blocks = [cache[NULL_BLOCK_ID] for cache in kv_caches(llm).values()]
        assert all(not block.any() for block in null_blocks)
        stats = kvwire.vllm.kvwire_stats(llm)
    assert cold == expected
    assert from_zeros != expected
    assert warm == expected
    assert cached == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
    # A hit loads every block of the full group and the window's blocks of the
    # sliding one; each connector saves them, and fewer sliding blocks than full.
    full_blocks = len(PROMPTS) * LOADABLE_BLOCKS
    assert sum(counters(stats, "blocks_loaded")) == full_blocks + len(PROMPTS) * WINDOW_BLOCKS
    # A tiered connector's saves are its pool's, or its disk's for the blocks written
    # around the pool.
    for saved in counters(stats, "blocks_saved", tiers=True):
        assert full_blocks + len(PROMPTS) * WINDOW_BLOCKS <= saved < 2 * full_blocks
    assert not any(counters(stats, "load_errors"))


@pytest.mark.slow
def test_a_wrapped_connector_without_hma_fails_at_start_naming_the_flag_and_serves_hma_off(
    tiny_hybrid_model: str, hybrid_tokens_without_connector: list[list[int]]
) -> None:
    config = kvwire_transfer_config(wrapping_profile(PlainConnector))
    with pytest.raises(VLLMConfigError, match="PlainConnector does not support it") as error:
        start_llm(tiny_hybrid_model, config)
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()  # what the failed start left
    assert "--disable-hybrid-kv-cache-manager" in str(error.value)
    with running_llm(tiny_hybrid_model, config, disable_hybrid_kv_cache_manager=True) as llm:
        # HMA off: one group of every layer, all blocks kept.
        assert group_kinds(llm) == [
            ("FullAttentionSpec", SLIDING_WINDOW, [LAYER(index) for index in range(4)])
        ]
        tokens, _ = generate(llm, PROMPTS)
    assert tokens == hybrid_tokens_without_connector


@pytest.mark.slow
def test_a_failed_asynchronous_load_on_a_hybrid_model_is_recomputed_with_identical_outputs(
    tiny_hybrid_model: str,
    hybrid_tokens_without_connector: list[list[int]],
    tmp_path: pathlib.Path,
) -> None:
    # vLLM stops on failed block ids with several KV cache groups; a failed
    # request (failed_recving) is what it recomputes there.
    profile = profile_with_directory("shared-storage.yaml", tmp_path)
    profile["kv_transfer_config"]["kv_connector_extra_config"]["async_load"] = True
    with running_llm(tiny_hybrid_model, kvwire_transfer_config(profile)) as llm:
        cold, _ = generate(llm, PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        assert rewrite_each_entry(tmp_path, flip_one_payload_byte) > 0
        assert llm.reset_prefix_cache()
        warm, cached = generate(llm, PROMPTS)
        stats = kvwire.vllm.kvwire_stats(llm)
    assert cold == warm == hybrid_tokens_without_connector
    assert cached == [0] * len(PROMPTS)
    assert stats["load_errors"] > 0


def _damage_every_pool_slot() -> int:
    """Make every slot of the in-process worker's CPU pool name another block; how many.

    The pool's payloads carry no checksum (only kvwire writes that memory), so
    a slot mixed up with another block is the damage a load must refuse.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    pool = get_kv_transfer_group().connector._worker.handler.pool
    for slot in range(pool.num_slots):
        name_another_block(pool, slot)
    return pool.num_slots


@pytest.mark.slow
def test_a_cpu_pool_slot_that_failed_an_asynchronous_load_is_forgotten_and_saved_again(
    tiny_hybrid_model: str,
    hybrid_tokens_without_connector: list[list[int]],
) -> None:
    # vLLM's output names the failed request, not its blocks: the adapter
    # tells the wrapped connector which blocks failed, so the pool forgets
    # them and saves them again once computed, instead of failing every load.
    profile = load_profile_mapping("cpu-offload.yaml")
    profile["kv_transfer_config"]["kv_connector_extra_config"]["async_load"] = True
    with running_llm(tiny_hybrid_model, kvwire_transfer_config(profile)) as llm:
        cold, _ = generate(llm, PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        assert _damage_every_pool_slot() > 0
        assert llm.reset_prefix_cache()
        recomputed, _ = generate(llm, PROMPTS)
        kvwire.vllm.wait_for_saves(llm)
        failed_loads = kvwire.vllm.kvwire_stats(llm)["load_errors"]
        assert llm.reset_prefix_cache()
        zero_kv_caches(llm)
        warm, cached = generate(llm, PROMPTS)
        stats = kvwire.vllm.kvwire_stats(llm)
    assert cold == recomputed == warm == hybrid_tokens_without_connector
    assert failed_loads > 0
    assert stats["load_errors"] == failed_loads  # the saved-again blocks load cleanly
    assert all(tokens > 0 for tokens in cached)


@pytest.mark.slow
def test_a_wrapped_hma_connector_gets_vllm_s_live_block_ids_per_group(
    tiny_hybrid_model: str,
) -> None:
    config = kvwire_transfer_config(wrapping_profile(GroupsConnector))
    with running_llm(tiny_hybrid_model, config) as llm:
        generate(llm, PROMPTS[:1])
        wrapped = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector
    ((call, (sliding, full)),) = wrapped.finished
    assert call == "request_finished_all_groups"
    # 300 prompt tokens and 7 decoded ones computed: 10 blocks in each group;
    # the sliding group's first blocks left the window and hold the null block.
    assert len(sliding) == len(full) == 10
    left = (300 + MAX_TOKENS - 1 - SLIDING_WINDOW + 1) // BLOCK_SIZE
    assert sliding[:left] == [NULL_BLOCK_ID] * left
    assert NULL_BLOCK_ID not in sliding[left:] + full
    assert not set(sliding) & set(full)  # one pool: an id is in one group at a time
    # The last step's lists are vLLM's live ones, nulls included.
    assert list(wrapped.scheduled.values()) == [(sliding, full)]


@pytest.mark.slow
def test_hybrid_model_in_vllm_s_default_multiprocess_engine_named_by_plugin_loads_its_warm_pass(
    tiny_hybrid_model: str,
    hybrid_tokens_without_connector: list[list[int]],
    tmp_path: pathlib.Path,
) -> None:
    # The engine core in a process of its own: the metadata (asynchronous
    # loads' block ids included) crosses processes as real pickles. No
    # kv_connector_module_path: kvwire's vllm.general_plugins entry point
    # registers the name in the engine core's process.
    profile = profile_with_directory("shared-storage.yaml", tmp_path)
    profile["kv_transfer_config"]["kv_connector_extra_config"]["async_load"] = True
    config = kvwire_transfer_config(profile)
    del config["kv_connector_module_path"]
    result = run_engine_process(
        tiny_hybrid_model,
        config,
        PROMPTS,
        MAX_TOKENS,
        tmp_path,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        passes=2,
    )
    assert result["tokens"] == [hybrid_tokens_without_connector] * 2
    assert result["cached"][1] == [LOADABLE_BLOCKS * BLOCK_SIZE] * len(PROMPTS)
    # Two groups (with HMA off, one group of every layer would load 9 blocks a prompt).
    assert result["stats"]["blocks_loaded"] == len(PROMPTS) * (LOADABLE_BLOCKS + WINDOW_BLOCKS)
