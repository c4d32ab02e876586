"""The Redis connector inside kvwire's engine, against a real server.

The invariant throughout: whatever happens to the server (killed, restarted,
corrupted values, evicted keys, out of memory), every request finishes and
its tokens are those of the same engine without a connector.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest

from kvwire.config import EngineConfig, ModelConfig, SchedulerConfig
from kvwire.connectors.offload import RedisConnector
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.interface.types import BlockStored
from kvwire.media.store.redis import RedisMedium
from tests.support.redis import (
    BLOCK_SIZE,
    RedisServer,
    distinct_full_blocks,
    distinct_prompt_blocks,
    generate,
    generate_with_stats,
    shared_prefix_workload,
    tiny_config,
    tokens,
    wait_until_available,
    with_redis,
)


def two_at_a_time() -> EngineConfig:
    """The tiny engine running two requests at a time: the others wait for later steps."""
    return attrs.evolve(tiny_config(), scheduler_config=SchedulerConfig(max_num_seqs=2))


def test_a_second_engine_loads_the_prefix_from_redis_and_generates_the_same_tokens(
    redis_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    config = with_redis(tiny_config(), redis_server.url, key_prefix)
    assert tokens(generate(config, workload)) == expected_tokens

    outputs, stats = generate_with_stats(config, workload)

    assert tokens(outputs) == expected_tokens
    # A fresh engine has no local cache, so its first request loads all seven
    # full prompt blocks (all but the last token's) from Redis.
    assert (outputs[0].local_cached_tokens, outputs[0].external_tokens) == (0, 28)
    # The others, admitted in the same step, share the common prefix it
    # loaded through the local cache and load only the rest from Redis: no
    # request computes a prompt token that Redis holds.
    assert all(output.local_cached_tokens + output.external_tokens == 28 for output in outputs)
    assert all(output.local_cached_tokens > 0 for output in outputs[1:])
    # So Redis served each distinct block exactly once.
    distinct_blocks = distinct_prompt_blocks(workload, BLOCK_SIZE)
    assert stats["blocks_loaded"] == distinct_blocks
    assert sum(output.external_tokens for output in outputs) == distinct_blocks * BLOCK_SIZE
    assert stats.get("load_errors", 0) == 0


def test_the_blocks_saved_to_redis_are_reported_stored_with_medium_redis(
    redis_server: RedisServer, key_prefix: str, workload: list[GenerationRequest]
) -> None:
    config = with_redis(tiny_config(), redis_server.url, key_prefix)
    with LLMEngine(config) as engine:
        engine.generate(workload)
        engine.wait_for_saves()
        events = list(engine.scheduler.kv_events)

    assert events and all(isinstance(e, BlockStored) and e.medium == "redis" for e in events)
    reported = sorted(h for e in events for h in e.block_hashes)
    # Server names are <key prefix><layout fingerprint>/<block hash hex>.
    held = sorted(
        bytes.fromhex(name.decode().rsplit("/", 1)[1])
        for name in redis_server.client().scan_iter(match=f"{key_prefix}*")
    )
    assert reported == held


def test_outputs_stay_identical_when_the_server_dies_mid_run(
    fault_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    # Most requests are looked up after the server died.
    config = with_redis(two_at_a_time(), fault_server.url, key_prefix)
    assert tokens(generate(config, workload)) == expected_tokens  # fills the server

    with LLMEngine(config) as engine:
        for request in workload:
            engine.add_request(request)
        engine.step()  # the first two requests load from the live server
        fault_server.kill()
        engine.run_until_done()
        outputs = [engine.output_of(request.request_id) for request in workload]
        stats = engine.connector_stats.data

    assert tokens(outputs) == expected_tokens
    assert stats["blocks_loaded"] > 0
    assert any(output.external_tokens == 0 for output in outputs)


def test_the_connector_reconnects_when_the_server_comes_back(
    fault_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    # Prompts that share nothing with the workload: after the restart they
    # can only be saved, and later loaded, through the re-established connections.
    later = [
        attrs.evolve(request, request_id=f"later-{request.request_id}")
        for request in shared_prefix_workload(seed=11, num_requests=3)
    ]
    expected_later = tokens(generate(tiny_config(), later))
    config = with_redis(tiny_config(), fault_server.url, key_prefix)
    with LLMEngine(config) as engine:
        fault_server.kill()
        assert tokens(engine.generate(workload)) == expected_tokens
        down_stats = dict(engine.connector_stats.data)
        fault_server.restart()
        stores = []
        for connector in (engine.scheduler_connector, engine.worker_connector):
            assert isinstance(connector, RedisConnector)
            assert isinstance(connector.medium, RedisMedium)
            stores.append(connector.medium.store)
        wait_until_available(*stores)
        assert tokens(engine.generate(later)) == expected_later

    assert down_stats["redis_saves_dropped"] > 0
    assert down_stats.get("blocks_saved", 0) == 0
    with LLMEngine(config) as warm:
        warm_outputs = warm.generate(later)
        stats = warm.connector_stats.data
    assert tokens(warm_outputs) == expected_later
    # Every distinct prompt block was saved after the restart, so a fresh
    # engine loads each of them from Redis, once.
    assert stats["blocks_loaded"] == distinct_prompt_blocks(later, BLOCK_SIZE)
    assert all(output.local_cached_tokens + output.external_tokens == 28 for output in warm_outputs)


def test_values_corrupted_in_the_server_are_never_loaded(
    redis_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    config = with_redis(tiny_config(), redis_server.url, key_prefix)
    generate(config, workload)
    client = redis_server.client()
    corrupted = 0
    for name in client.scan_iter(match=f"{key_prefix}*"):
        offset = int(client.strlen(name)) - 1
        last = client.getrange(name, offset, offset)[0]
        client.setrange(name, offset, bytes([last ^ 0x01]))
        corrupted += 1
    assert corrupted > 0

    outputs, stats = generate_with_stats(config, workload)

    assert tokens(outputs) == expected_tokens
    assert stats["corrupt_entries"] > 0
    assert stats.get("blocks_loaded", 0) == 0
    # Deleted as they were found, so they stop being hits for every engine:
    # what the server holds now loads whole.
    again, stats_again = generate_with_stats(config, workload)
    assert tokens(again) == expected_tokens
    assert stats_again.get("corrupt_entries", 0) == 0


def test_a_key_evicted_between_lookup_and_load_is_recomputed(
    redis_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    generate(with_redis(tiny_config(), redis_server.url, key_prefix), workload)
    evicting = with_redis(
        tiny_config(),
        redis_server.url,
        key_prefix,
        connector="EvictingRedisConnector",
        module_path="tests.support.redis",
    )

    with LLMEngine(evicting) as engine:
        outputs = engine.generate(workload[:1])
        stats = engine.connector_stats.data

    assert tokens(outputs) == expected_tokens[:1]
    assert stats["load_errors"] == 1
    assert outputs[0].num_load_failures == 1


@pytest.mark.slow
def test_outputs_stay_identical_under_a_memory_limit_with_lru_eviction(
    fault_server: RedisServer, key_prefix: str
) -> None:
    # 16 KiB blocks of unrelated prompts: about 2.6 MiB for a 1 MiB allowance
    # (which also has to hold the connections' buffers).
    wide = attrs.evolve(
        tiny_config(),
        model_config=ModelConfig(num_layers=4, head_size=64, vocab_size=300, max_model_len=512),
    )
    many = shared_prefix_workload(seed=5, num_requests=24, shared_prefix_ratio=0.0)
    expected = tokens(generate(wide, many))
    fault_server.cap_memory(1024 * 1024, "allkeys-lru")
    config = with_redis(wide, fault_server.url, key_prefix, max_save_bytes_in_flight="4MiB")

    assert tokens(generate(config, many[:-1])) == expected[:-1]
    assert int(fault_server.client().info("stats")["evicted_keys"]) > 0
    # Which blocks survive is up to Redis's sampled LRU, whose clock ticks
    # once a second: once it has ticked past every block saved so far, the
    # last request's blocks are the newest, and the evictions its own saves
    # cause take older ones. So at least its blocks survive for the consumer.
    _wait_until_the_lru_clock_passes_every_key(fault_server, key_prefix)
    assert tokens(generate(config, many[-1:])) == expected[-1:]
    # A consumer only: its own saves would evict the survivors it is about to load.
    consumer = with_redis(wide, fault_server.url, key_prefix, kv_role="kv_consumer")
    with LLMEngine(consumer) as warm:
        assert tokens(warm.generate(many)) == expected
        stats = warm.connector_stats.data
    assert stats["blocks_loaded"] > 0  # the survivors were used


def _wait_until_the_lru_clock_passes_every_key(
    server: RedisServer, key_prefix: str, timeout_s: float = 10.0
) -> None:
    """Poll until every key under ``key_prefix`` has been idle for a whole tick of the LRU clock.

    ``OBJECT IDLETIME`` reads a key's idle time in whole ticks without touching it.
    """
    client = server.client()
    names = list(client.scan_iter(match=key_prefix + "*", count=1000))
    assert names, "no block survived to wait for"
    deadline = time.monotonic() + timeout_s
    while min(int(client.object("idletime", name)) for name in names) < 1:
        assert time.monotonic() < deadline, f"the LRU clock did not tick within {timeout_s} s"
        time.sleep(0.02)


def test_outputs_stay_identical_when_a_full_server_rejects_saves(
    fault_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    fault_server.cap_memory(16 * 1024, "noeviction")
    config = with_redis(tiny_config(), fault_server.url, key_prefix)

    # Every block the engine computed (all tokens but the last sampled one's),
    # a common prefix once, was saved once: stored, rejected by the full
    # server, or dropped because every staging slot was still busy writing.
    computed = [
        (*request.prompt_token_ids, *generated[:-1])
        for request, generated in zip(workload, expected_tokens, strict=True)
    ]
    expected_saves = distinct_full_blocks(computed, BLOCK_SIZE)

    def saves_accounted_for(stats: dict[str, Any]) -> int:
        return sum(
            stats.get(name, 0) for name in ("blocks_saved", "redis_saves_rejected", "saves_dropped")
        )

    with LLMEngine(config) as engine:
        assert tokens(engine.generate(workload)) == expected_tokens
    # Closed: the writes still running when the last request ended are counted too.
    stats = dict(engine.connector_stats.data)
    assert stats["redis_saves_rejected"] > 0
    assert saves_accounted_for(stats) == expected_saves
    with LLMEngine(config) as warm:
        assert tokens(warm.generate(workload)) == expected_tokens
        # Only what the full server accepted can come back.
        assert warm.connector_stats.data.get("blocks_loaded", 0) <= stats.get("blocks_saved", 0)


def test_asynchronous_loads_cut_off_by_a_dying_server_end_in_identical_outputs(
    fault_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    config = with_redis(two_at_a_time(), fault_server.url, key_prefix, async_load=True)
    generate(config, workload)

    with LLMEngine(config) as engine:
        for request in workload:
            engine.add_request(request)
        engine.step()  # the first loads are on their way in the background
        fault_server.kill()
        engine.run_until_done()
        outputs = [engine.output_of(request.request_id) for request in workload]

    assert tokens(outputs) == expected_tokens
    assert all(output.error is None for output in outputs)
