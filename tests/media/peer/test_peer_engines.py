"""Engines sharing KV peer to peer: engine processes, real NIXL over loopback, a real redis-server.

Peers ``a`` and ``b`` run in processes of their own for the whole module;
each test's reader is an engine in the test's process. The invariant
throughout: whatever the directory says and whatever happens to a peer,
the reader's tokens are those of the same model without a connector, and
it never waits past its deadline.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import redis

from kvwire.config import EngineConfig
from kvwire.engine.engine import GenerationRequest, LLMEngine, RequestOutput
from kvwire.media.peer._directory import Location
from tests.support.peers import BLOCK_SIZE, PeerProcess, peer_config, prompts
from tests.support.redis import RedisServer, distinct_prompt_blocks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"kvwire-test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="module")
def peers(redis_server: RedisServer, prefix: str) -> Iterator[dict[str, PeerProcess]]:
    started: dict[str, PeerProcess] = {}
    try:
        for name in ("a", "b"):
            started[name] = PeerProcess(
                url=redis_server.url, key_prefix=prefix, peer_name=f"{prefix}{name}"
            )
        yield started
    finally:
        for peer in started.values():
            peer.stop()


def reference(requests: list[GenerationRequest]) -> list[tuple[int, ...]]:
    config = attrs.evolve(peer_config("redis://127.0.0.1:1/0", "unused:"), kv_transfer_config=None)
    with LLMEngine(config) as engine:
        return [output.output_token_ids for output in engine.generate(requests)]


def read_as(
    config: EngineConfig, requests: list[GenerationRequest]
) -> tuple[list[RequestOutput], dict[str, Any], float]:
    """``requests`` on a fresh reader engine: its outputs, connector stats and seconds taken."""
    started = time.monotonic()
    with LLMEngine(config) as engine:
        outputs = engine.generate(requests)
        stats = dict(engine.connector_stats.data)
    return outputs, stats, time.monotonic() - started


def entries(server: RedisServer, prefix: str) -> dict[bytes, Location]:
    """Every directory entry under ``prefix``: Redis key -> location."""
    client = server.client()
    found = {}
    for key in client.scan_iter(match=f"{prefix}peer/*".encode()):
        value = client.get(key)
        if value is not None:
            location = Location.decode(value)
            assert location is not None
            found[key] = location
    return found


def rewrite(client: redis.Redis, rewritten: dict[bytes, Location]) -> None:
    for key, location in rewritten.items():
        client.set(key, location.encode(), keepttl=True)


# The directory on one server, or on a Redis Cluster: each entry and peer
# record then on the master of its slot.
@pytest.mark.parametrize("directory", ["redis_server", "redis_cluster"])
def test_the_decode_engine_pulls_the_prefill_engines_blocks_and_continues_identically(
    request: pytest.FixtureRequest, directory: str, prefix: str
) -> None:
    url = request.getfixturevalue(directory).url
    requests = prompts(seed=21, num_requests=3)
    producer = PeerProcess(
        url=url,
        key_prefix=prefix,
        peer_name=f"{prefix}prefill",
        kv_role="kv_producer",
    )
    try:
        prefill = producer.generate([attrs.evolve(r, max_tokens=1) for r in requests])
        consumer = peer_config(url, prefix, kv_role="kv_consumer", peer_name=f"{prefix}decode")
        outputs, stats, _ = read_as(consumer, requests)
    finally:
        producer.stop()

    assert [o.output_token_ids for o in outputs] == reference(requests)
    assert prefill["stats"]["blocks_saved"] > 0
    # Every full prompt block (all but the last token's) came from the prefill engine,
    # pulled once: the requests after the first share the prefix it pulled, locally.
    full = (len(requests[0].prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert [o.local_cached_tokens + o.external_tokens for o in outputs] == [full] * len(requests)
    assert outputs[0].external_tokens == full
    assert stats["peer_blocks_pulled"] == stats["blocks_loaded"]
    assert stats["blocks_loaded"] == distinct_prompt_blocks(requests, BLOCK_SIZE)
    assert "peer_blocks_local" not in stats and "load_errors" not in stats


def test_a_third_engine_pulls_each_block_from_whichever_peer_holds_it(
    redis_server: RedisServer, prefix: str, peers: dict[str, PeerProcess]
) -> None:
    from_a, from_b = prompts(seed=1), prompts(seed=2)
    peers["a"].generate(from_a)
    peers["b"].generate(from_b)
    holders = {location.peer for location in entries(redis_server, prefix).values()}
    assert holders == {f"{prefix}a", f"{prefix}b"}

    both = from_a + from_b
    reader = peer_config(redis_server.url, prefix, peer_name=f"{prefix}c")
    outputs, stats, _ = read_as(reader, both)

    assert [o.output_token_ids for o in outputs] == reference(both)
    assert stats["peer_blocks_pulled"] == distinct_prompt_blocks(both, BLOCK_SIZE)
    assert stats["blocks_loaded"] == stats["peer_blocks_pulled"]
    assert "load_errors" not in stats
    # The reader announced what it saved, and withdrew it when it closed.
    holders = {location.peer for location in entries(redis_server, prefix).values()}
    assert holders == {f"{prefix}a", f"{prefix}b"}


def test_a_load_asks_the_directory_once_where_its_blocks_are(
    redis_server: RedisServer, prefix: str, peers: dict[str, PeerProcess]
) -> None:
    requests = prompts(seed=7, num_requests=1, prompt_len=70)
    peers["a"].generate(requests)
    client = redis_server.client()
    client.config_resetstat()

    reader = peer_config(redis_server.url, prefix, peer_name=f"{prefix}c", kv_role="kv_consumer")
    outputs, stats, _ = read_as(reader, requests)

    assert [o.output_token_ids for o in outputs] == reference(requests)
    assert stats["peer_blocks_pulled"] == stats["blocks_loaded"] == 70 // BLOCK_SIZE
    # The scheduler side's lookup is the only one: the worker reads where it found them.
    lookups = client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
    assert lookups == 1


def test_a_slot_reused_between_lookup_and_read_is_refused_and_computed_again(
    redis_server: RedisServer, prefix: str, peers: dict[str, PeerProcess]
) -> None:
    requests = prompts(seed=3)
    before = set(entries(redis_server, prefix))
    peers["a"].generate(requests)
    announced = {k: v for k, v in entries(redis_server, prefix).items() if k not in before}
    # Each block's entry now names the slot of another of a's blocks: what a
    # reader finds when a's pool gave the slot to another block after its lookup.
    keys = sorted(announced)
    rotated = keys[1:] + keys[:1]
    rewrite(
        redis_server.client(),
        {
            key: attrs.evolve(announced[key], slot=announced[o].slot)
            for key, o in zip(keys, rotated, strict=True)
        },
    )

    reader = peer_config(redis_server.url, prefix, peer_name=f"{prefix}c", kv_role="kv_consumer")
    outputs, stats, _ = read_as(reader, requests)

    assert [o.output_token_ids for o in outputs] == reference(requests)
    assert stats.get("blocks_loaded", 0) == 0
    assert stats["peer_stale_entries"] > 0
    assert stats["load_errors"] == stats["peer_stale_entries"]
    # The stale entries it read were withdrawn: no reader trips over them again.
    gone = set(announced) - set(entries(redis_server, prefix))
    assert len(gone) == stats["peer_entries_withdrawn"] == stats["peer_stale_entries"]


def test_entries_naming_a_peer_that_never_existed_are_misses_and_withdrawn(
    redis_server: RedisServer, prefix: str, peers: dict[str, PeerProcess]
) -> None:
    requests = prompts(seed=4)
    before = set(entries(redis_server, prefix))
    peers["b"].generate(requests)
    announced = {k: v for k, v in entries(redis_server, prefix).items() if k not in before}
    ghost = f"{prefix}ghost"
    rewrite(
        redis_server.client(),
        {key: attrs.evolve(location, peer=ghost) for key, location in announced.items()},
    )

    reader = peer_config(redis_server.url, prefix, peer_name=f"{prefix}c", kv_role="kv_consumer")
    outputs, stats, _ = read_as(reader, requests)

    assert [o.output_token_ids for o in outputs] == reference(requests)
    assert stats.get("blocks_loaded", 0) == 0
    assert stats["peer_read_failures"] == stats["load_errors"] > 0
    gone = set(announced) - set(entries(redis_server, prefix))
    assert len(gone) == stats["peer_entries_withdrawn"] == stats["peer_read_failures"]


def test_a_peer_stalled_then_killed_mid_run_costs_a_deadline_and_nothing_else(
    redis_server: RedisServer, prefix: str
) -> None:
    stalled_set, killed_set = prompts(seed=5), prompts(seed=6)
    # A slow heartbeat: its record outlives the stall, so the reader really tries it.
    victim = PeerProcess(
        url=redis_server.url, key_prefix=prefix, peer_name=f"{prefix}d", peer_heartbeat_s=10
    )
    try:
        victim.generate(stalled_set)
        victim.generate(killed_set)
        victim.stall()
        reader = peer_config(
            redis_server.url,
            prefix,
            peer_name=f"{prefix}c",
            kv_role="kv_consumer",
            transfer_timeout_s=2,
        )
        stalled_outputs, stalled_stats, stalled_s = read_as(reader, stalled_set)
        victim.kill()
        killed_outputs, killed_stats, killed_s = read_as(reader, killed_set)
    finally:
        victim.kill()

    assert [o.output_token_ids for o in stalled_outputs] == reference(stalled_set)
    assert stalled_stats.get("blocks_loaded", 0) == 0
    # The stalled peer's reads ran into the deadline (those in flight beside one given
    # up on may fail at once): every block looked up was a load error, computed again.
    assert stalled_stats["load_timeouts"] > 0
    assert stalled_stats["load_errors"] == stalled_stats["lookup_hit_blocks"]
    # Each load waited out its deadline at most (the reader's run is a few steps).
    assert stalled_s < 30
    assert [o.output_token_ids for o in killed_outputs] == reference(killed_set)
    assert killed_stats.get("blocks_loaded", 0) == 0
    assert killed_stats["peer_read_failures"] == killed_stats["load_errors"] > 0
    assert killed_s < 30
