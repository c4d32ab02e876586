"""The tiered connector over the peer medium: a CPU pool per engine in front of every peer's.

Engines write their blocks through (or spill them) into their own peer
pool, announced in a real redis-server's directory; another engine finds
them there, pulls them over NIXL (loopback) into its own CPU pool, and
serves its next reuse from memory. Tokens always equal those of the same
model without a connector.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from kvwire.blocks.format import HEADER_SIZE
from kvwire.engine.engine import GenerationRequest, LLMEngine
from kvwire.media.peer._directory import Location
from tests.support.engines import renamed
from tests.support.peers import BLOCK_SIZE, PeerProcess, peer_config, prompts, tiered_peer_config
from tests.support.redis import (
    RedisServer,
    distinct_prompt_blocks,
    redis_server,
    redis_server_process,
)

__all__ = ["redis_server", "redis_server_process"]

# NIXL's UCX over loopback TCP and shared memory, here and in the peer processes.
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

pytestmark = pytest.mark.slow

# One entry of the tiny model at this block size: its header and one block of both layers.
ENTRY_BYTES = 2048 + HEADER_SIZE


@pytest.fixture
def prefix() -> str:
    return f"kvwire-test:{uuid.uuid4().hex[:12]}:"


def reference(requests: list[GenerationRequest]) -> list[tuple[int, ...]]:
    config = attrs.evolve(peer_config("redis://127.0.0.1:1/0", "unused:"), kv_transfer_config=None)
    with LLMEngine(config) as engine:
        return [output.output_token_ids for output in engine.generate(requests)]


def holders(server: RedisServer, prefix: str) -> dict[str, int]:
    """How many directory entries under ``prefix`` each peer holds."""
    client = server.client()
    counts: dict[str, int] = {}
    for key in client.scan_iter(match=f"{prefix}peer/*".encode()):
        value = client.get(key)
        location = Location.decode(value) if value is not None else None
        if location is not None:
            counts[location.peer] = counts.get(location.peer, 0) + 1
    return counts


@pytest.fixture
def writer(redis_server: RedisServer, prefix: str) -> Iterator[PeerProcess]:
    """An engine with the tiered connector writing through to its peer pool, in a process."""
    process = PeerProcess(
        tiered=True, url=redis_server.url, key_prefix=prefix, peer_name=f"{prefix}a"
    )
    try:
        yield process
    finally:
        process.stop()


def test_an_engine_brings_another_engines_blocks_into_its_pool_and_reuses_them_from_memory(
    redis_server: RedisServer, prefix: str, writer: PeerProcess
) -> None:
    requests = prompts(seed=31)
    written = writer.generate(requests)["stats"]
    distinct = distinct_prompt_blocks(requests, BLOCK_SIZE)
    # Written through as part of each save (generated blocks too): published once
    # the saves ended.
    assert written["tier1.written_through_blocks"] == written["blocks_saved"] >= distinct
    assert holders(redis_server, prefix) == {f"{prefix}a": written["blocks_saved"]}

    config = tiered_peer_config(redis_server.url, prefix, peer_name=f"{prefix}b")
    with LLMEngine(config) as engine:
        first = engine.generate(requests)
        engine.reset_prefix_cache()
        again = engine.generate(renamed(requests, "-again"))
        engine.wait_for_saves()
        stats = dict(engine.connector_stats.data)
        during = holders(redis_server, prefix)

    expected = reference(requests)
    assert [o.output_token_ids for o in first] == expected
    assert [o.output_token_ids for o in again] == expected
    # Every block pulled from a's pool once, into b's pool (both passes counted):
    # the second pass loaded them from b's pool, in memory.
    assert stats["tier1.peer_blocks_pulled"] == stats["tier1.promoted_blocks"] == distinct
    assert sum(o.external_tokens for o in again) >= distinct * BLOCK_SIZE
    assert "load_errors" not in stats
    # What b brought in stays a's; b publishes only what it computed and saved (the
    # generated tokens' blocks, the same as a's: then named by b's newer entries).
    assert during[f"{prefix}b"] == stats["tier1.written_through_blocks"] == stats["blocks_saved"]
    assert during[f"{prefix}a"] + during[f"{prefix}b"] == written["blocks_saved"]
    # b withdrew its own entries when it closed.
    assert f"{prefix}b" not in holders(redis_server, prefix)


# Split over two ranks, each spilled write is published once both ranks wrote their share.
@pytest.mark.parametrize("ranks", [1, 2])
def test_spill_publishes_what_the_pool_evicts_and_brings_it_back_from_the_peer_pool(
    redis_server: RedisServer, prefix: str, ranks: int
) -> None:
    requests, others = prompts(seed=32, num_requests=6, prompt_len=40), prompts(seed=33)
    # A pool of 12 blocks: the other requests' blocks evict the first ones', which spill.
    config = tiered_peer_config(
        redis_server.url,
        prefix,
        peer_name=f"{prefix}c",
        write_policy="spill",
        pool_bytes=12 * ENTRY_BYTES // ranks,
        tensor_parallel_size=ranks,
    )
    with LLMEngine(config) as engine:
        first = engine.generate(requests)
        engine.reset_prefix_cache()
        engine.generate(others)
        engine.reset_prefix_cache()
        spilled = dict(engine.connector_stats.data)
        published = holders(redis_server, prefix).get(f"{prefix}c", 0)
        again = engine.generate(renamed(requests, "-again"))
        stats: dict[str, Any] = dict(engine.connector_stats.data)

    expected = reference(requests)
    assert [o.output_token_ids for o in first] == expected
    assert [o.output_token_ids for o in again] == expected
    # Every block evicted was spilled (by each rank: the workers' counts add up) and,
    # once its write was reported, published.
    assert spilled["tier1.spilled_blocks"] == ranks * spilled["evicted_blocks"] > 0
    assert 0 < published <= spilled["tier1.spilled_blocks"]
    # Brought back from this engine's own peer pool (a local copy), through the pool.
    assert stats["tier1.peer_blocks_local"] == ranks * stats["tier1.promoted_blocks"] > 0
    assert sum(o.external_tokens for o in again) >= stats["tier1.promoted_blocks"] * BLOCK_SIZE
    assert "load_errors" not in stats and "tier1.writes_not_made" not in stats
