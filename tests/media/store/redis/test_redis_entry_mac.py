"""Redis with a MAC key: values forged in the server (valid checksum) are never loaded."""

from __future__ import annotations

import pytest

from kvwire.engine.engine import GenerationRequest
from tests.support.entries import forge
from tests.support.redis import (
    RedisServer,
    generate,
    generate_with_stats,
    tiny_config,
    tokens,
    with_redis,
)

VARIABLE = "KVWIRE_TEST_MAC_KEY"


def forge_every_value(server: RedisServer, key_prefix: str) -> int:
    client = server.client()
    names = list(client.scan_iter(match=f"{key_prefix}*"))
    for name in names:
        client.set(name, forge(client.get(name)))
    return len(names)


def test_without_a_mac_key_values_forged_in_the_server_change_the_outputs(
    redis_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
) -> None:
    config = with_redis(tiny_config(), redis_server.url, key_prefix)
    generate(config, workload)
    assert forge_every_value(redis_server, key_prefix) > 0

    outputs, stats = generate_with_stats(config, workload)

    assert stats.get("corrupt_entries", 0) == 0
    assert stats["blocks_loaded"] > 0
    assert tokens(outputs) != expected_tokens


def test_with_a_mac_key_values_forged_in_the_server_are_recomputed(
    redis_server: RedisServer,
    key_prefix: str,
    workload: list[GenerationRequest],
    expected_tokens: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VARIABLE, "0123456789abcdef" * 4)
    config = with_redis(tiny_config(), redis_server.url, key_prefix, mac_key_env=VARIABLE)
    assert tokens(generate(config, workload)) == expected_tokens
    assert forge_every_value(redis_server, key_prefix) > 0

    outputs, stats = generate_with_stats(config, workload)

    assert tokens(outputs) == expected_tokens
    assert stats["corrupt_entries"] > 0
    assert stats.get("blocks_loaded", 0) == 0
