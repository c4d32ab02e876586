"""Forged entries in a real vLLM engine: refused by their MAC, and no byte of them is ever read.

A writer without the MAC key overwrites each entry's payload with 0xFF
bytes (NaN in the tiny model's float32 cache) and keeps its header. The store
media read an entry straight into its cache block and verify it there, so
each refused entry has already landed in a block when it is refused; vLLM
frees those blocks without clearing them and gives them out again, as
another request's partly filled last block among others, whose unwritten
slots its attention reads with weight 0: 0 x NaN is NaN, and that request's
every token would be 0. kvwire zeroes every block a load reports failed
before vLLM hears of it: every round's tokens equal those without a connector.

A KV cache of 70 blocks for 8 prompts of 10 blocks each makes vLLM reuse
freed blocks within each round.
"""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import kvwire.vllm
from kvwire.blocks.format import HEADER_SIZE
from tests.support.vllm import (
    counters,
    generate_within,
    kvwire_transfer_config,
    load_profile_mapping,
    profile_with_directory,
    running_llm,
    shared_prompts,
    with_redis_url,
)

MAC_VARIABLE = "KVWIRE_TEST_FORGED_MAC_KEY"
PROMPTS = shared_prompts(count=8)
SMALL_CACHE = {"num_gpu_blocks_override": 70, "max_model_len": 512}
ROUNDS = 3
PASS_LIMIT_S = 90.0
FORGED_BYTE = 0xFF


def forged(entry: bytes) -> bytes:
    return entry[:HEADER_SIZE] + bytes([FORGED_BYTE]) * (len(entry) - HEADER_SIZE)


def forge_directory(root: pathlib.Path) -> Callable[[], int]:
    def forge() -> int:
        entries = [path for path in root.rglob("*") if path.is_file() and len(path.name) == 64]
        for path in entries:
            path.write_bytes(forged(path.read_bytes()))
        return len(entries)

    return forge


def forge_redis(url: str, key_prefix: str) -> Callable[[], int]:
    import redis

    def forge() -> int:
        client = redis.Redis.from_url(url)
        try:
            keys = list(client.scan_iter(match=f"{key_prefix}*", count=1000))
            for key in keys:
                entry = client.get(key)
                if entry is not None and len(entry) > HEADER_SIZE:
                    client.set(key, forged(entry))
            return len(keys)
        finally:
            client.close()

    return forge


def directory_profile(tmp_path: pathlib.Path) -> tuple[dict[str, Any], Callable[[], int]]:
    profile = profile_with_directory("shared-storage.yaml", tmp_path)
    return profile, forge_directory(tmp_path)


def redis_profile(redis_url: str) -> tuple[dict[str, Any], Callable[[], int]]:
    key_prefix = f"kvwire:test-forged-{uuid.uuid4().hex[:8]}:"
    profile = with_redis_url(load_profile_mapping("redis.yaml"), redis_url, key_prefix)
    return profile, forge_redis(redis_url, key_prefix)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("medium", "load_async"),
    [("directory", True), ("redis", False)],
    ids=["directory-async", "redis-sync"],
)
def test_forged_entries_are_refused_and_every_rounds_tokens_equal_no_connectors(
    medium: str,
    load_async: bool,
    tiny_model: str,
    tokens_without_connector: list[list[int]],
    tmp_path: pathlib.Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MAC_VARIABLE, "0123456789abcdef" * 4)
    if medium == "directory":
        profile, forge = directory_profile(tmp_path)
    else:
        profile, forge = redis_profile(request.getfixturevalue("redis_url"))
    extra = profile["kv_transfer_config"]["kv_connector_extra_config"]
    # Hits never withheld: every round's loads are tried, and refused.
    extra.update(mac_key_env=MAC_VARIABLE, async_load=load_async, load_failures_to_pause=1000)
    with running_llm(tiny_model, kvwire_transfer_config(profile), **SMALL_CACHE) as llm:
        cold, _ = generate_within(llm, PROMPTS, PASS_LIMIT_S)
        rounds = []
        for _ in range(ROUNDS):
            kvwire.vllm.wait_for_saves(llm)
            assert forge() > 0
            assert llm.reset_prefix_cache()
            tokens, _ = generate_within(llm, PROMPTS, PASS_LIMIT_S)
            rounds.append(tokens)
        stats = kvwire.vllm.kvwire_stats(llm)

    assert cold[:3] == tokens_without_connector
    assert rounds == [cold] * ROUNDS
    refused = sum(counters(stats, "corrupt_entries", tiers=True))
    scrubbed = sum(counters(stats, "load_blocks_scrubbed", tiers=True))
    assert refused > 0 and scrubbed >= refused
